"""The shared block of norm rows of ``PerSampleGradNorms``: the fused layers' C++ backwards write into rows of
one (slots, 2, B) tensor, reset by one multiply at each forward and read by ``sq_norms`` as one matrix-vector
product. Checked against torch.func in float64 (and the general path) where the block is read, where it
cannot be (a layer that did not run, a Python-recorded layer), across batch-size changes, and for the NaN a
read before the backward gives."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticlab.gns import PerSampleGradNorms, kernels
from elasticlab.gns.reference import func_sq_norms

pytestmark = pytest.mark.skipif("linear_norms" not in kernels._OPERATORS,
                                reason="elasticlab._C without the C++ autograd functions")


def _mlp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6, bias=False), nn.Tanh(), nn.Linear(6, 3),
                      nn.LayerNorm(3)).double()
    m[4].weight.requires_grad_(False)                # bias only: its weight row is written, never read
    return m


def _mse(out, y):
    return (out - y).pow(2).mean()


@pytest.fixture
def mv_calls(monkeypatch):
    calls = []
    real = torch.mv
    monkeypatch.setattr(torch, "mv", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _step(psg, model, x, y):
    model.zero_grad(set_to_none=True)
    _mse(model(x), y).backward()
    return psg.sq_norms()


def test_one_product_reads_the_block_across_batch_sizes(mv_calls):
    model = _mlp()
    seen = []
    with PerSampleGradNorms(model) as psg:
        for B in (4, 4, 2, 4):                        # a new batch size reallocates the block, and back
            x, y = torch.randn(B, 5, dtype=torch.float64), torch.randn(B, 3, dtype=torch.float64)
            got = _step(psg, model, x, y)
            per = psg.param_sq_norms()                # the same rows, read one by one (general path)
            torch.testing.assert_close(got, sum(per.values()), rtol=1e-12, atol=0)
            seen.append((x, y, got))
    assert len(mv_calls) == 4                         # every read was one matrix-vector product
    for x, y, got in seen:                            # (torch.func outside the context: its hooks mutate)
        torch.testing.assert_close(got, func_sq_norms(model, _mse, x, y), rtol=1e-10, atol=1e-14)


def test_a_read_before_the_backward_is_nan(mv_calls):
    model = _mlp()
    x, y = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    with PerSampleGradNorms(model) as psg:
        _step(psg, model, x, y)
        model(x)                                      # a new forward resets the rows: no backward yet
        assert psg.sq_norms().isnan().all()
        assert _step(psg, model, x, y).isfinite().all()


def test_an_overflowed_row_nothing_needs_is_not_read(mv_calls):
    # A frozen weight beside a trained bias (BitFit): the C++ backward still writes the weight's row. Here it
    # overflows float32 (|x_b|² ~ 1e40) while every needed row is finite: the read must stay finite.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    with torch.no_grad():
        model[0].weight.mul_(1e-20)
    model[0].weight.requires_grad_(False)
    x, y = torch.randn(6, 5) * 1e20, torch.randn(6, 3)
    with PerSampleGradNorms(model) as psg:
        got = _step(psg, model, x, y)
        per = psg.param_sq_norms()
        assert psg._block._stray is not None and len(mv_calls) == 1
    assert set(per) == {"0.bias", "2.weight", "2.bias"}
    assert got.isfinite().all()
    torch.testing.assert_close(got, sum(per.values()), rtol=1e-6, atol=0)
    want = func_sq_norms(model.double(), _mse, x.double(), y.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)


def test_a_layer_that_did_not_run_is_left_out(mv_calls):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
            self.use_b = True

        def forward(self, x):
            return self.out(torch.tanh(self.b(x) if self.use_b else self.a(x)))

    torch.manual_seed(1)
    model = Branchy().double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    got = {}
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        for i, use_b in enumerate((True, False, True)):
            model.use_b = use_b
            model.zero_grad(set_to_none=True)
            (model(x) - y).pow(2).sum().backward()
            got[i] = psg.sq_norms()
    # step 0: `a` has never held rows, so the block holds all there is; then a holder of rows is idle in
    # each step (b, then a): the general path
    assert len(mv_calls) == 1
    for i, use_b in enumerate((True, False, True)):
        model.use_b = use_b
        want = func_sq_norms(model, lambda o, t: (o - t).pow(2).sum(), x, y)
        torch.testing.assert_close(got[i], want, rtol=1e-10, atol=1e-14)


def test_python_recorded_layers_take_the_general_path(mv_calls):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3)).double()
    x, y = torch.randint(0, 10, (5, 3)), torch.randn(5, 3, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        model.zero_grad(set_to_none=True)
        (model(x) - y).pow(2).sum().backward()
        got = psg.sq_norms()
    torch.testing.assert_close(got, func_sq_norms(model, lambda o, t: (o - t).pow(2).sum(), x, y),
                               rtol=1e-10, atol=1e-14)
    assert not mv_calls                               # the embedding's norms come from its hook
