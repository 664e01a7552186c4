"""Row-wise layers called on the examples folded into dim 0 with their positions (gns.folds): OPT's MLP on
(B·T, D), a (T, B, D) tensor flattened. Against one backward per example in float64; before, the readers
raised "layers disagree on the batch size"."""
import pytest
import torch
from layer_check import eager_then_compiled
from torch import nn

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.reference import example_param_sq_norms


class Folded(nn.Module):
    """An OPT-style block: the MLP and its LayerNorm on the hidden states folded to (B·T, D), then unfolded;
    ``time_major``: folded from (T, B, D) instead."""

    def __init__(self, D=6, H=10, time_major=False):
        super().__init__()
        self.inp, self.norm = nn.Linear(4, D), nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)
        self.rms, self.head, self.time_major = nn.RMSNorm(D), nn.Linear(D, 3), time_major

    def forward(self, x):
        h = self.inp(x)                                       # (B, T, D)
        B, T, D = h.shape
        hf = h.transpose(0, 1).reshape(-1, D) if self.time_major else h.reshape(-1, D)
        hf = hf + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(hf))))
        hf = self.rms(hf)
        h = hf.view(T, B, D).transpose(0, 1) if self.time_major else hf.view(B, T, D)
        return self.head(h.mean(1))


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out, y, reduction="sum")


def _by_example(m, batch, s):
    return _loss(m(batch[0][s]), batch[1][s])


@pytest.mark.parametrize("T", [7, 5], ids=["T7", "T=B"])
@pytest.mark.parametrize("time_major", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_folded_rows_match_per_example_backward(fused, time_major, T):
    """T=B: both layouts fit the (5, 5, D) view, and the batch's place is read further back (before: the
    readers' batch sizes disagreed)."""
    torch.manual_seed(0)
    model = Folded(time_major=time_major).double()
    x, y = torch.randn(5, T, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    want = example_param_sq_norms(model, (_loss(model(x[b:b + 1]), y[b:b + 1]) for b in range(5)))
    with PerSampleGradNorms(model, fused=fused, loss_reduction="sum") as psg:
        _loss(model(x), y).backward()
        got = psg.param_sq_norms()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-12, msg=k)


class Gain(nn.Module):
    """A leaf of no registered type (the generic rule, which reads folded rows with their layout)."""

    def __init__(self, D):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x * self.w


@pytest.mark.parametrize("time_major", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_folded_rows_under_compile_take_the_layout_an_eager_step_found(fused, time_major):
    """Under torch.compile the graph is not read: the compiled steps after an eager one unfold each layer's
    rows by the layout found there, and their norms are one backward per example's; with eager_first=False
    a compiled step before any eager one still raises (before: they raised at every compiled step); by
    default the compiled model's first step is the eager one (eager_first), and all three are exact."""
    torch.manual_seed(0)
    model = Folded(time_major=time_major).double()
    model.norm = nn.Sequential(Gain(6), model.norm).double()   # (a generic-rule leaf on the rows too)
    batch = (torch.randn(5, 7, 4, dtype=torch.float64), torch.randint(0, 3, (5,)))
    eager_then_compiled(model, _by_example, (), [batch], fused=fused, loss_reduction="sum", eager_first=False,
                        refused={0: r"disagree on the batch size|'norm.0' \(Gain\) ran without the batch .* "
                                    r"under torch.compile"})
    eager_then_compiled(model, _by_example, [batch], [batch, batch], fused=fused, loss_reduction="sum")
    # no eager step of the user's: eager_first runs the compiled model's first step eagerly
    eager_then_compiled(model, _by_example, (), [batch] * 3, fused=fused, loss_reduction="sum")


@pytest.mark.parametrize("time_major", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_folded_rows_under_compile_at_another_sequence_length(fused, time_major):
    """The layout found eagerly at T=7 serves compiled steps at T=9 and T=4 (as many examples, other rows
    per example: the same fold); before, a new length found no layout and the readers raised that the
    layers disagree on the batch size."""
    torch.manual_seed(0)
    model = Folded(time_major=time_major).double()
    batches = [(torch.randn(5, T, 4, dtype=torch.float64), torch.randint(0, 3, (5,))) for T in (7, 9, 4)]
    eager_then_compiled(model, _by_example, batches[:1], batches[1:], fused=fused, loss_reduction="sum")


def test_rows_not_found_folded_still_raise():
    """A Linear on rows whose layout the graph does not show (learned latents, k·B of them) is not unfolded:
    the readers' batch sizes disagree, as before."""
    class Latents(nn.Module):
        def __init__(self):
            super().__init__()
            self.lat, self.fc, self.inp = nn.Parameter(torch.randn(8, 4)), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.inp(x).sum(1) + self.fc(self.lat).sum()

    model = Latents()
    with PerSampleGradNorms(model, strict=False) as psg:
        model(torch.randn(4, 3, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="disagree on the batch size"):
            psg.sq_norms()


def test_batch_factor_is_read_through_transposes_permutes_and_matmuls():
    """Where the batch lies in a (B, B, …) tensor, from its graph: (outer, inner) of its flat index."""
    from elasticlab.gns import folds
    B = 3
    x = torch.randn(B, B, 4)                                   # (the model's input: the batch first)
    w = torch.randn(5, 4, requires_grad=True)
    h = x @ w.t()                                              # (B, B, 5), made from the input: dim 0
    assert folds.batch_factor(h.grad_fn, tuple(h.shape), B) == (1, B * 5)
    t = h.transpose(0, 1)                                      # dim 1
    assert folds.batch_factor(t.grad_fn, tuple(t.shape), B) == (B, 5)
    heads = (t * 2).reshape(B, B, 5, 1).permute(2, 1, 0, 3)    # (5, B, B, 1): the batch dim 1
    assert folds.batch_factor(heads.grad_fn, tuple(heads.shape), B) == (5, B)
    back = heads.permute(1, 2, 0, 3).reshape(B, B * 5) @ torch.randn(B * 5, 2)     # (B, 2): dim 0
    assert folds.batch_factor(back.grad_fn, tuple(back.shape), B) == (1, 2)
    mixed = t.sum(0)                                           # (a reduction: not read)
    assert folds.batch_factor(mixed.grad_fn, tuple(mixed.shape), B) is None
    flat = t.reshape(B * B, 5)                                 # rows j·B + b: time-major
    assert folds.find(flat + 1, B) == folds.Fold(B, B, False)
    assert folds.find(h.reshape(B * B, 5), B) == folds.Fold(B, B, True)


def test_windows_of_as_many_rows_as_examples_are_read_through_a_convolution_and_a_pad():
    """Swin's window partition at B = 2 with 2 windows a side: the fold's view reads (2, 2, 2, 4, 4, C) and
    its first two dims could each be the batch; the batch is read back through the permute, the pad and the
    patch convolution to the pixels (before: not found, and the relative position bias refused)."""
    from elasticlab.gns import folds
    B, C = 2, 3
    w = torch.randn(C, 1, 1, 1, requires_grad=True)
    h = torch.nn.functional.conv2d(torch.randn(B, 1, 8, 8), w).permute(0, 2, 3, 1)        # (B, 8, 8, C)
    h = torch.nn.functional.pad(h, (0, 0, 0, 0, 0, 0))
    win = h.view(B, 2, 4, 2, 4, C).permute(0, 1, 3, 2, 4, 5).reshape(B * 4, 16, C)
    assert folds.find(win * 1.0, B) == folds.Fold(B, 4, True)
    rolled = torch.roll(h, (1, 1), (1, 2))                     # (a shift of the other dims keeps the batch)
    assert folds.batch_factor(rolled.grad_fn, tuple(rolled.shape), B) == (1, 64 * C)
    across = torch.roll(h, 1, 0)                               # (a shift across the batch: not read)
    assert folds.batch_factor(across.grad_fn, tuple(across.shape), B) is None


def test_parameters_alone_or_a_flattened_roll_are_not_read_as_batch_first():
    """(B, B, D) learned latents expanded over dim 1 (the batch second), a roll of the flattened tensor, or
    attention whose batch would lie among the positions: no layout is claimed (a wrong one is silent)."""
    from elasticlab.gns import folds
    B = 3
    lat = torch.randn(B, 1, 4, requires_grad=True)
    e = lat.expand(B, B, 4) * 2                                # (the batch is dim 1 here: not readable)
    assert folds.batch_factor(e.grad_fn, tuple(e.shape), B) is None
    assert folds.find(e.reshape(B * B, 4), B) is None
    h = torch.nn.functional.linear(torch.randn(B, B, 4), torch.randn(4, 4, requires_grad=True))
    assert folds.batch_factor(h.grad_fn, tuple(h.shape), B) == (1, B * 4)
    flat = torch.roll(h, 1)                                    # (no dims: rolled across the batch)
    assert folds.batch_factor(flat.grad_fn, tuple(flat.shape), B) is None
    q = h.reshape(1, 1, B * B, 4)                               # (the batch among the query's positions)
    att = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert folds.batch_factor(att.grad_fn, tuple(att.shape), B) is None


def test_layernorm_over_the_rows_stops_the_walk():
    """A LayerNorm normalizing over dim 0 too mixes the rows: the walk back from a folded Linear must not
    cross it (else the norms would be read per example, silently wrong)."""
    from elasticlab.gns import folds
    h = torch.randn(3, 4, 5, requires_grad=True)
    flat = h.reshape(12, 5)
    assert folds.find(flat * 2, 3) == folds.Fold(3, 4, True)            # row-wise: found
    mixed = torch.nn.functional.layer_norm(flat, (12, 5))               # rows mixed: not
    assert folds.find(mixed, 3) is None
    assert folds.find(torch.nn.functional.layer_norm(flat, (5,)), 3) == folds.Fold(3, 4, True)


def test_layout_cache_is_bounded(monkeypatch):
    """Variable input shapes (a sequence length per step) keep at most MAX_SHAPES layouts per layer."""
    from elasticlab.gns import folds
    monkeypatch.setattr(folds, "MAX_SHAPES", 3)
    torch.manual_seed(0)
    model = Folded()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        for T in (2, 3, 4, 6, 7, 8):                      # (six shapes, three kept)
            _loss(model(torch.randn(5, T, 4)), torch.randint(0, 3, (5,))).backward()
            assert psg.sq_norms().shape == (5,)
        sizes = [len(s.folds) for s in psg._slots]
    assert max(sizes) == 3


@pytest.mark.parametrize("time_major", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_folded_rows_under_compile_at_another_batch(fused, time_major):
    """The layout an eager step read at B = 5 serves compiled steps at B = 3 and 6 (an epoch's last, smaller
    batch; a larger one), as many rows per example, and at B = 3 with T = 9 (other rows per example, the
    same order): exact (before: the readers raised "layers disagree on the batch size", and GNSMonitor with
    them; at T = 9 too, before the layout was taken for another length)."""
    torch.manual_seed(0)
    model = Folded(time_major=time_major).double()
    model.norm = nn.Sequential(Gain(6), model.norm).double()   # (a generic-rule leaf on the rows too)
    y = torch.randint(0, 3, (6,))
    shapes = ((5, 7), (3, 7), (6, 7), (3, 9))
    batches = [(torch.randn(b, t, 4, dtype=torch.float64), y[:b]) for b, t in shapes]
    eager_then_compiled(model, _by_example, batches[:1], batches[1:], fused=fused, loss_reduction="sum")
