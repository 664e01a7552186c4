"""The Triton outer-product path without a GPU (issue 14): what ``triton_outer.outer_norms`` allocates and
launches, and which calls of the Linear rules reach it with or without the weight gradient. The kernel is
replaced by a stand-in that fills the partial norms from the PyTorch reference; the kernel itself is tested
on CUDA (tests/gns/test_kernels.py, gpu-marked)."""
import types

import pytest
import torch
from torch import nn

from elasticlab.gns import PerSampleGradNorms, form_choice, kernels, triton_launch, triton_outer


class FakeKernel:
    """``_outer_norms_kernel[grid](*args, **meta)``: records the launch and writes each example's squared norm
    into the first tile of the partial buffer (the rest zero) and, with WITH_GRAD, Σ_b G_b into split 0."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            a, d, partial, grad = args[:4]
            self.launches.append((grid, args, meta))
            norms, g = kernels.seq_linear_outer_norms_ref(a, d, with_grad=True)
            partial.zero_()
            partial[:, 0] = norms
            if meta["WITH_GRAD"]:
                grad.zero_()
                grad[0] = g
        return launch


@pytest.fixture
def fake_triton(monkeypatch):
    fake = FakeKernel()
    monkeypatch.setattr(triton_outer, "triton", types.SimpleNamespace(cdiv=lambda x, y: -(-x // y)),
                        raising=False)
    monkeypatch.setattr(triton_outer, "_outer_norms_kernel", fake, raising=False)
    monkeypatch.setattr(triton_launch, "sm_count", lambda dev: 132)
    return fake


@pytest.mark.parametrize("B,T,Din,Dout", [(4, 16, 96, 300), (64, 8, 256, 256)])
def test_norms_only_allocates_no_gradient_buffer(fake_triton, B, T, Din, Dout):
    torch.manual_seed(0)
    a, d = torch.randn(B, T, Din), torch.randn(B, T, Dout)
    want, want_g = kernels.seq_linear_outer_norms_ref(a, d, with_grad=True)

    norms, grad = triton_outer.outer_norms(a, d, with_grad=False)
    (grid, args, meta), = fake_triton.launches
    partial, buf = args[2], args[3]
    assert grad is None and meta["WITH_GRAD"] is False
    assert buf is partial and buf.numel() == B * grid[0]           # no (split, Dout, Din) buffer
    torch.testing.assert_close(norms, want)

    norms, grad = triton_outer.outer_norms(a, d, with_grad=True)
    grid, args, meta = fake_triton.launches[-1]
    assert meta["WITH_GRAD"] is True and args[3].shape == (grid[1], Dout, Din)
    torch.testing.assert_close(norms, want)
    torch.testing.assert_close(grad, want_g)


def test_linear_rules_ask_for_the_gradient_only_when_fused(monkeypatch):
    """With the Triton path preferred, the hook rule of a sequence Linear takes norms only and the fused
    backward takes norms, Σ_b G_b and the per-example bias gradients from the same call; both give the
    reference norms and gradients (weight and bias)."""
    calls = []

    def outer(a, d, with_grad, bias=False):
        calls.append((with_grad, bias))
        out = kernels.seq_linear_outer_norms_ref(a, d, with_grad)
        return (*out, d.sum(1)) if bias else out

    monkeypatch.setattr(triton_outer, "takes", lambda like, T, din, dout: True)
    monkeypatch.setattr(triton_outer, "outer_norms", outer)
    monkeypatch.setattr(form_choice, "use_gram", lambda *a, **k: False)
    torch.manual_seed(0)
    lin, x = nn.Linear(6, 5), torch.randn(3, 7, 6)
    lin(x).pow(2).sum().backward()
    plain, plain_b = lin.weight.grad.clone(), lin.bias.grad.clone()
    got, got_b = {}, {}
    for fused in (False, True):
        lin.zero_grad()
        with PerSampleGradNorms(lin, loss_reduction="sum", fused=fused) as n:
            lin(x).pow(2).sum().backward()
        got[fused], got_b[fused] = n.param_sq_norms()["weight"], n.param_sq_norms()["bias"]
        torch.testing.assert_close(lin.weight.grad, plain)
        torch.testing.assert_close(lin.bias.grad, plain_b)
    assert calls == [(False, False), (True, True)]       # the fused backward takes the bias sums from it
    torch.testing.assert_close(got[True], got[False])
    g = 2 * lin(x).detach()                                        # d(Σ y²)/dy per example
    ref = torch.einsum("bto,bti->boi", g, x).pow(2).sum((1, 2))
    torch.testing.assert_close(got[False], ref)
    torch.testing.assert_close(got_b[True], g.sum(1).pow(2).sum(1))
