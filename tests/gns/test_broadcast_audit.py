"""The broadcast audit (elasticlab.gns.broadcast): a covered layer whose output is broadcast over the batch (a
positional embedding on arange(T)) gets only the batch-summed gradient. With T equal to the batch its norms
were silently wrong; now the first forward of each input signature is audited (hook rules and fused
forwards) and the readers raise a RuntimeError naming the layer (an embedding on an index whose dim 0 is
not the batch is followed to its broadcast instead, gns.layers.broadcast_params) (the forward runs on, so
that a GNSMonitor with several backwards a step, which needs no per-example norms, is not stopped). Layers
whose outputs are used per example pass, with exact norms (torch.func, float64)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import GNSMonitor, PerSampleGradNorms, broadcast
from elasticlab.gns.reference import example_param_sq_norms, func_param_sq_norms

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
V, E = 11, 4


def ce(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1), reduction="sum")


class GPTish(nn.Module):
    """Token and positional embeddings, a Linear head; ``pos_form`` is how the positions reach the sum:
    ``arange`` (T,) broadcast, ``row`` (1, T) broadcast (HF's position_ids), ``expand_out`` the embedded
    positions expanded over the batch, ``expand_index`` the index expanded over the batch (per example)."""

    def __init__(self, T: int, pos_form: str):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, E), nn.Embedding(T, E), nn.Linear(E, V)
        self.pos_form = pos_form

    def forward(self, idx):
        B, T = idx.shape
        ar = torch.arange(T)
        p = {"arange": lambda: self.pos(ar), "row": lambda: self.pos(ar[None]),
             "expand_out": lambda: self.pos(ar).unsqueeze(0).expand(B, -1, -1),
             "expand_index": lambda: self.pos(ar.expand(B, T))}[self.pos_form]()
        return self.head(torch.tanh(self.tok(idx) + p))


class Latents(nn.Module):
    """A Linear on a batch-less input (learned latents, N of them) added to every example."""

    def __init__(self, N: int, D: int = 5):
        super().__init__()
        self.register_buffer("latents", torch.randn(N, D))
        self.proj, self.inp, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 2)

    def forward(self, x):                                   # x (B, N, D)
        return self.head(torch.tanh(self.inp(x) + self.proj(self.latents)))


def step(model, x, y, loss, fused=True):
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as psn:
        loss(model(x), y).backward()
        return psn.param_sq_norms()


@pytest.fixture
def data():
    torch.manual_seed(0)
    return lambda B, T: (torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T)))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("form", ["arange", "row", "expand_out"])
@pytest.mark.parametrize("B", [8, 3])
def test_broadcast_positional_embedding_is_followed_or_raises_naming_it(data, form, B, fused):
    """An index whose dim 0 is not the batch (``row`` (1, T); ``arange`` (T,) with T ≠ B) is followed to the
    broadcast of the embedding's output (gns.layers.broadcast_params): exact norms. Where dim 0 equals the
    batch (T = B), the rule cannot tell, and the audit makes the readers raise naming the layer (before: an
    error in every case)."""
    idx, y = data(B, 8)
    model = GPTish(8, form).double()
    if form != "row" and B == 8:
        with pytest.raises(RuntimeError, match=r"module 'pos' \(Embedding\).*broadcast over the batch of "
                                             rf"{B}.*pos\.unsqueeze\(0\)\.expand\(B, -1\)"):
            step(model, idx, y, ce, fused)
        return
    got, ref = step(model, idx, y, ce, fused), func_param_sq_norms(model, ce, idx, y)
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12)


def test_without_the_audit_equal_sizes_give_wrong_norms_silently(data, monkeypatch):
    """What the audit prevents: T = B, the positions read as examples, no error."""
    monkeypatch.setattr(broadcast, "ENABLED", False)
    idx, y = data(8, 8)
    model = GPTish(8, "arange").double()
    got, ref = step(model, idx, y, ce), func_param_sq_norms(model, ce, idx, y)
    assert got["pos.weight"].shape == ref["pos.weight"].shape
    assert not torch.allclose(got["pos.weight"], ref["pos.weight"], rtol=1e-3)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("B", [8, 3])
def test_index_expanded_over_the_batch_passes_with_exact_norms(data, B, fused):
    idx, y = data(B, 8)
    model = GPTish(8, "expand_index").double()
    got, ref = step(model, idx, y, ce, fused), func_param_sq_norms(model, ce, idx, y)
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_linear_on_batch_less_latents_raises(fused):
    torch.manual_seed(0)
    model = Latents(N=4).double()
    x, y = torch.randn(4, 4, 5, dtype=torch.float64), torch.randn(4, 4, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"module 'proj' \(Linear\) ran on an input of shape \(4, 5\)"):
        step(model, x, y, lambda o, t: (o - t).pow(2).sum(), fused)


class PerExample(nn.Module):
    """Outputs used per example in ways that enlarge them: a label embedding (B,) added after unsqueeze(1)
    to every position, a Linear's (B, H) state expanded over a new leading dimension of L ≠ B rows (a
    stacked RNN's initial state), a conv output upsampled."""

    def __init__(self, L=2):
        super().__init__()
        self.lab, self.inp, self.init = nn.Embedding(V, E), nn.Linear(E, E), nn.Linear(E, E)
        self.conv, self.L = nn.Conv1d(E, E, 1), L

    def forward(self, x, labels):                           # x (B, T, E), labels (B,)
        h = torch.tanh(self.inp(x) + self.lab(labels)[:, None, :])                    # (B, T, E)
        h0 = self.init(h.mean(1)).unsqueeze(0).expand(self.L, -1, -1)               # (L, B, E)
        up = F.interpolate(self.conv(h.transpose(1, 2)), scale_factor=2)             # (B, E, 2T)
        return up.mean(2) + h0.mean(0)


@pytest.mark.parametrize("fused", [True, False])
def test_per_example_uses_that_enlarge_outputs_pass(fused):
    torch.manual_seed(0)
    B = T = 4                                              # sizes that coincide, where a rule could misread
    model = PerExample().double()
    x, labels = torch.randn(B, T, E, dtype=torch.float64), torch.randint(0, V, (B,))
    y = torch.randn(B, E, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as psn:
        (model(x, labels) - y).pow(2).sum().backward()
        got = psn.param_sq_norms()
    ref = example_param_sq_norms(model, ((model(x[i:i + 1], labels[i:i + 1]) - y[i:i + 1]).pow(2).sum()
                                         for i in range(B)))
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12)


def test_audit_walks_once_per_input_signature(data, monkeypatch):
    walks = []
    real = broadcast._consumers
    monkeypatch.setattr(broadcast, "_consumers", lambda roots: walks.append(1) or real(roots))
    model = GPTish(8, "expand_index").double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        for B in (3, 3, 5, 3, 5):
            idx, y = data(B, 8)
            model.zero_grad()
            ce(model(idx), y).backward()
            assert psn.sq_norms().shape == (B,)
        with torch.no_grad():                               # no graph: not audited, and not counted
            model(data(6, 8)[0])
        assert len(walks) == 2
        idx, y = data(6, 8)
        ce(model(idx), y).backward()
    assert len(walks) == 3


def test_fills_batch():
    assert broadcast.fills_batch((8, 4), (8, 8, 4), 8)          # a new leading dimension, the batch
    assert broadcast.fills_batch((1, 8, 4), (3, 8, 4), 3)       # a 1 made the batch
    assert not broadcast.fills_batch((8, 4), (2, 8, 4), 8)      # a new leading dimension, not the batch
    assert not broadcast.fills_batch((8, 1, 4), (8, 5, 4), 8)   # the batch kept, another dim broadcast
    assert not broadcast.fills_batch((8, 4), (8, 12), 8)        # not a broadcast (a Linear's wider output)
    assert not broadcast.fills_batch((1, 4), (1, 4), 1)


def test_every_step_of_a_signature_raises_and_micro_batch_monitoring_runs_on(data):
    model = GPTish(8, "arange")
    with PerSampleGradNorms(model) as psn:
        for _ in range(2):                                  # audited once, the verdict kept for its shape
            idx, y = data(8, 8)
            ce(model(idx), y).backward()
            with pytest.raises(RuntimeError, match="module 'pos'"):
                psn.sq_norms()
    monitor = GNSMonitor(model, accumulation="sum")
    for _ in range(2):
        with monitor.step():
            for _ in range(2):                              # two micro-batches: no per-example norms needed
                idx, y = data(8, 8)
                ce(model(idx), y).backward()
    assert [h["method"] for h in monitor.history] == ["micro_batch"] * 2


@pytest.mark.parametrize("fused", [True, False])
def test_input_in_a_dict_is_audited(fused):
    """The batch found one level into the model's arguments (a dict, as data loaders give): the forward is
    audited, where before only top-level tensors were looked at and B = T passed silently."""
    torch.manual_seed(7)
    inner = GPTish(T=4, pos_form="arange")

    class DictIn(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            return self.inner(batch["idx"])

    model = DictIn()
    idx = torch.randint(0, V, (4, 4))
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as psn:
        ce(model({"idx": idx}), idx).backward()
        with pytest.raises(RuntimeError, match="'inner.pos'"):
            psn.sq_norms()
