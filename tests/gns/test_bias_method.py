"""A parent's method that looks its batch-less embedding up and hands the result on in a new layout (T5's
``compute_bias``), under torch.compile (gns.layers.bias_method): the layout read from a meta pass, the
lookup over the batch in that layout, and a method of another form refused by name as before."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layer_check import eager_then_compiled
from torch import nn
from torch._dynamo.utils import counters

from elasticlab.gns.layers import bias_method
from elasticlab.gns.layers.bias_method import layout, over_batch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False),
       st.integers(0, 2), st.integers(1, 3))
def test_layout_of_any_permute_and_unit_dims(shape, rnd, extra, B):
    """A view made of a permute and unit dims added (one leading): its layout is read, and the lookup
    over the batch laid out so equals each example's batch-less view."""
    looked = torch.empty(shape, device="meta")
    perm = list(range(len(shape)))
    rnd.shuffle(perm)
    out = looked.permute(perm)
    for _ in range(extra):
        out = out.unsqueeze(rnd.randint(0, out.dim()))
    out = out.unsqueeze(0)
    order = layout(looked, out)
    assert order is not None
    real = torch.randn(shape, dtype=torch.float64)
    want = real.permute(perm)
    want = want.reshape(out.shape)      # (the same unit dims: sizes agree position by position)
    got = over_batch(real.unsqueeze(0).expand(B, *shape).clone(), order, out.shape)
    assert got.shape == (B, *out.shape[1:])
    for b in range(B):
        torch.testing.assert_close(got[b:b + 1], want, rtol=0, atol=0)


@pytest.mark.parametrize("make", [
    lambda t: t.permute(2, 0, 1).contiguous().unsqueeze(0),       # a copy, not a view
    lambda t: (t * 2).permute(2, 0, 1).unsqueeze(0),              # arithmetic
    lambda t: t[:, 1:].permute(2, 0, 1).unsqueeze(0),             # a slice
    lambda t: t.permute(2, 0, 1),                                 # no leading unit dim for the batch
    lambda t: t[:, :1].expand(-1, 4, -1).permute(2, 0, 1).unsqueeze(0),   # one column expanded
    lambda t: None,
])
def test_layout_refuses_what_is_not_a_view_of_the_whole_lookup(make):
    looked = torch.empty(3, 4, 2, device="meta")
    assert layout(looked, make(looked)) is None


class BiasAttention(nn.Module):
    """One head-wise attention whose logits get a bias per clamped (query, key) offset, looked up inside
    ``compute_bias`` and laid out as T5's (1, H, q, k) (``scaled``: multiplied by 2 after, not a view)."""

    def __init__(self, D=4, H=2, buckets=5, scaled=False):
        super().__init__()
        self.H, self.buckets, self.scaled = H, buckets, scaled
        self.qkv, self.head = nn.Linear(D, 3 * D), nn.Linear(D, 2)
        self.relative_attention_bias = nn.Embedding(buckets, H)

    def compute_bias(self, q, k, device=None):
        pos = torch.arange(k, device=device)[None, :] - torch.arange(q, device=device)[:, None]
        values = self.relative_attention_bias(pos.clamp(-(self.buckets // 2), self.buckets // 2)
                                              + self.buckets // 2)
        values = values.permute([2, 0, 1]).unsqueeze(0)
        return values * 2 if self.scaled else values

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, D // self.H).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) + self.compute_bias(T, T, x.device)
        return self.head((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


def _loss(m, x, s):
    return m(x[s]).square().sum()


@pytest.mark.parametrize("eager_first", [True, False])
def test_compute_bias_under_compile_matches_per_example_backward(eager_first, monkeypatch):
    """Compiled steps (after an eager one, or from the first) equal one backward per example, bias table
    included. The layout and index learned once (in the eager step, or at the first compiled call, a graph
    break), the method is traced from then on."""
    torch.manual_seed(0)
    model = BiasAttention().double()
    xs = [torch.randn(3, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in (1, 2)]
    calls = []           # of the patched method's eager part (it sets Dynamo's callback aside)

    class Counted(bias_method.CallbackAside):
        def __enter__(self):
            calls.append(1)
            return super().__enter__()
    monkeypatch.setattr(bias_method, "CallbackAside", Counted)
    breaks, counts = [], []
    for steps in (xs, xs + xs):
        counters.clear()
        calls.clear()
        eager_then_compiled(model, _loss, eager=xs[:1] if eager_first else (), compiled=steps,
                            eager_first=eager_first, loss_reduction="sum")
        assert "compute_bias" not in model.__dict__                    # (put back at the exit)
        breaks.append(sum(n for why, n in counters["graph_break"].items() if "_Patch" in why))
        counts.append(len(calls))
    assert (breaks[0] == 0) == eager_first              # (compiled from the first: a break at that call)
    assert counts[0] == counts[1]                       # (the later compiled steps do not run it eagerly)


def test_compute_bias_not_a_view_is_refused_by_name_under_compile():
    """A method whose result is not a view of the lookup is left as it was: the compiled step's readers
    raise naming the embedding, as before."""
    torch.manual_seed(0)
    model = BiasAttention(scaled=True).double()
    x = torch.randn(3, 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    eager_then_compiled(model, _loss, eager=[x], compiled=[x], eager_first=False, loss_reduction="sum",
                        refused={0: "'relative_attention_bias' .Embedding. ran without the batch"})


def test_compute_bias_under_compile_at_several_lengths():
    """Sequence lengths changing between compiled steps (Dynamo recompiles, then traces the lengths as
    symbols, whose calls the learned lookups cannot key: the method breaks the graph there): each step still
    equals one backward per example."""
    torch.manual_seed(0)
    model = BiasAttention().double()
    xs = [torch.randn(3, T, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
          for T in (6, 7, 8, 9, 7)]
    eager_then_compiled(model, _loss, eager=xs[:1], compiled=xs, loss_reduction="sum")
