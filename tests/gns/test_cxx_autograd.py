"""The fused Linear, Conv, LayerNorm and GroupNorm as C++ autograd functions (csrc/autograd/)
against their Python autograd.Functions (``kernels.USE_CXX_AUTOGRAD = False``) and against torch.func."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticlab.gns import PerSampleGradNorms, form_choice, kernels
from elasticlab.gns.reference import func_param_sq_norms

pytestmark = pytest.mark.skipif("linear_norms" not in kernels._OPERATORS,
                                reason="elasticlab._C without the C++ autograd functions")


class Block(nn.Module):
    def __init__(self, d=6, bias=True, ln_bias=True):
        super().__init__()
        self.ln = nn.LayerNorm(d, bias=ln_bias)
        self.up = nn.Linear(d, 9, bias=bias)
        self.down = nn.Linear(9, 3)

    def forward(self, x):
        return self.down(torch.tanh(self.up(self.ln(x))))


def _norms(model, x, cxx: bool, autocast=None):
    """(per-example squared norms, {param: grad}) of Σ out² with the C++ or the Python fused path."""
    old = kernels.USE_CXX_AUTOGRAD
    kernels.USE_CXX_AUTOGRAD = cxx
    calls = []
    real = kernels.cxx_autograd

    def spy(name, t):
        op = real(name, t)
        calls.append(op is not None)
        return op
    kernels.cxx_autograd = spy
    try:
        model.zero_grad(set_to_none=True)
        with PerSampleGradNorms(model, loss_reduction="sum") as n:
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                out = model(x)
            (out.float() if autocast is not None else out).pow(2).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return n.param_sq_norms(), grads, calls
    finally:
        kernels.USE_CXX_AUTOGRAD = old
        kernels.cxx_autograd = real


def _check_cxx_against_python_and_func(model, x):
    """The C++ function's norms and gradients (every fused layer on it) against the Python path's and
    torch.func's per-example gradients of Σ_t out_b², in float64."""
    got, g_cxx, calls = _norms(model, x, cxx=True)
    assert calls and all(calls)                              # every fused layer took the C++ function
    ref, g_py, calls_py = _norms(model, x, cxx=False)
    assert not any(calls_py)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12)
        assert torch.isfinite(got[k]).all()
    for k in g_py:
        torch.testing.assert_close(g_cxx[k], g_py[k], rtol=1e-10, atol=1e-12)
    ref = func_param_sq_norms(model, lambda out, _: out.pow(2).sum(), x, torch.zeros(x.shape[0]))
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 6), (4, 7, 6), (3, 2, 5, 6)])
@pytest.mark.parametrize("bias", [True, False])
def test_cxx_matches_python_and_torch_func(shape, bias):
    torch.manual_seed(0)
    model = Block(bias=bias, ln_bias=bias).double()
    x = torch.randn(*shape, dtype=torch.float64)
    _check_cxx_against_python_and_func(model, x)


class GNNet(nn.Module):
    def __init__(self, c=6, groups=3):
        super().__init__()
        self.gn = nn.GroupNorm(groups, c)
        self.gn2 = nn.GroupNorm(1, c)
        self.head = nn.Linear(c, 2)

    def forward(self, x):
        h = torch.tanh(self.gn2(torch.sin(self.gn(x))))
        return self.head(h.flatten(2).mean(-1)) if h.dim() > 2 else self.head(h)


@pytest.mark.parametrize("shape,channels_last", [((4, 6, 5, 3), False), ((4, 6, 5, 3), True),
                                                 ((5, 6, 7), False), ((3, 6), False),
                                                 ((3, 6, 2, 3, 4), False)])
def test_group_norm_cxx_matches_python_and_torch_func(shape, channels_last):
    torch.manual_seed(5)
    model = GNNet().double()
    x = torch.randn(*shape, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    _check_cxx_against_python_and_func(model, x)


def test_group_norm_cxx_under_bf16_autocast_matches_python():
    torch.manual_seed(6)
    model = GNNet()
    x = torch.randn(4, 6, 5, 3).bfloat16()                 # half inputs: statistics recomputed in float32
    got, g_cxx, calls = _norms(model, x, cxx=True, autocast=torch.bfloat16)
    assert all(calls)
    ref, g_py, _ = _norms(model, x, cxx=False, autocast=torch.bfloat16)
    for k in ref:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
    for k in g_py:
        torch.testing.assert_close(g_cxx[k], g_py[k], rtol=1e-5, atol=1e-6)


class ConvNet(nn.Module):
    def __init__(self, nd=2, bias=True):
        super().__init__()
        conv = nn.Conv1d if nd == 1 else nn.Conv2d
        self.c1 = conv(4, 6, 3, stride=2, padding=1, bias=bias)
        self.c2 = conv(6, 6, 3, padding=2, dilation=2, groups=3)
        self.c3 = conv(6, 4, 1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.c3(torch.tanh(self.c2(torch.tanh(self.c1(x)))))
        return self.head(h.flatten(2).mean(-1))


@pytest.mark.parametrize("nd,bias", [(2, True), (2, False), (1, True)])
@pytest.mark.parametrize("form", ["grouped", "gram", "outer"])
@pytest.mark.parametrize("chunk", [None, 200])
def test_conv_cxx_matches_python_and_torch_func(monkeypatch, nd, bias, form, chunk):
    """Every form (the CPU's grouped convolution, Gram, and CUDA's outer form over the patches, forced here),
    chunked or not, against the Python path and torch.func."""
    from elasticlab.gns.layers import conv as conv_rule
    monkeypatch.setattr(form_choice, "use_gram", lambda *a, **k: form == "gram")
    if form == "outer":
        monkeypatch.setattr(conv_rule, "_cxx_form", lambda *a: 0)
    if chunk is not None:
        monkeypatch.setitem(conv_rule.CONV_CHUNK_ELEMS, "cpu", chunk)
    torch.manual_seed(7)
    model = ConvNet(nd, bias).double()
    x = torch.randn(5, 4, *((9, 7) if nd == 2 else (11,)), dtype=torch.float64)
    _check_cxx_against_python_and_func(model, x)


def test_cxx_under_bf16_autocast_matches_python():
    torch.manual_seed(1)
    model = Block()
    x = torch.randn(4, 8, 6)
    got, g_cxx, calls = _norms(model, x, cxx=True, autocast=torch.bfloat16)
    assert all(calls)
    ref, g_py, _ = _norms(model, x, cxx=False, autocast=torch.bfloat16)
    for k in ref:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
    for k in g_py:
        assert g_cxx[k].dtype == torch.float32
        torch.testing.assert_close(g_cxx[k], g_py[k], rtol=1e-5, atol=1e-6)


def test_frozen_weight_and_input_gradients():
    """A frozen weight (bias trains) gets no norm; the input gradient still flows; no backward leaves NaN
    rows unread."""
    torch.manual_seed(2)
    lin = nn.Linear(6, 4)
    lin.weight.requires_grad_(False)
    x = torch.randn(5, 3, 6, requires_grad=True)
    with PerSampleGradNorms(lin, loss_reduction="sum") as n:
        lin(x).pow(2).sum().backward()
    norms = n.param_sq_norms()
    assert list(norms) == ["bias"]
    d = 2 * lin(x).detach()
    torch.testing.assert_close(norms["bias"], d.sum(1).pow(2).sum(1))
    x2 = x.detach().clone().requires_grad_()
    lin(x2).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_no_grad_and_inference_mode_run_the_plain_layer():
    torch.manual_seed(3)
    model = Block()
    x = torch.randn(2, 5, 6)
    want = model(x)
    with PerSampleGradNorms(model):
        with torch.no_grad():
            torch.testing.assert_close(model(x), want)
        with torch.inference_mode():
            torch.testing.assert_close(model(x), want)


def test_bad_buffer_is_a_clear_error():
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"norms must be \(2, B\) = \(2, 3\)"):
        torch.ops.elasticlab.linear_norms(x, w, None, torch.empty(2, 5), 0, None)
    with pytest.raises(RuntimeError, match="form must be 0"):
        torch.ops.elasticlab.linear_norms(x, w, None, torch.empty(2, 3), 7, None)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("kind", ["block", "groupnorm", "conv"])
def test_cxx_on_cuda_matches_python(precision, kind):
    """On CUDA: the C++ functions (cuBLAS outer form or Gram, LayerNorm kernel) against the Python ones, at a
    sequence length the Triton kernel does not take (T=300); float64 also against torch.func."""
    torch.manual_seed(4)
    dt = torch.float64 if precision == "fp64" else torch.float32
    if kind == "conv":
        model = ConvNet().to("cuda", dt)
        x = torch.randn(6, 4, 33, 31, device="cuda", dtype=dt)
    elif kind == "block":
        model = Block(d=64).to("cuda", dt)
        x = torch.randn(6, 300, 64, device="cuda", dtype=dt)
    else:
        model = GNNet(c=64, groups=8).to("cuda", dt)
        x = torch.randn(6, 64, 9, 7, device="cuda", dtype=dt)
    ac = torch.bfloat16 if precision == "bf16" else None

    def run(cxx):
        old = kernels.USE_CXX_AUTOGRAD
        kernels.USE_CXX_AUTOGRAD = cxx
        try:
            model.zero_grad(set_to_none=True)
            with PerSampleGradNorms(model, loss_reduction="sum") as n:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac is not None):
                    out = model(x)
                out.float().pow(2).sum().backward()
            return n.param_sq_norms(), {k: p.grad.clone() for k, p in model.named_parameters()}
        finally:
            kernels.USE_CXX_AUTOGRAD = old

    got, g1 = run(True)
    ref, g2 = run(False)
    tol = dict(rtol=1e-9, atol=1e-10) if precision == "fp64" else dict(rtol=2e-3, atol=1e-4)
    for k in ref:
        assert got[k].dtype == (torch.float64 if precision == "fp64" else torch.float32)
        torch.testing.assert_close(got[k], ref[k], **tol)
    for k in g2:
        torch.testing.assert_close(g1[k], g2[k], **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("cxx", [True, False])
@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16"])
def test_cuda_grouped_conv_form_matches_the_patches(cxx, precision):
    """conv.GROUPED_ON_CUDA: convolutions' per-example weight gradients from one grouped convolution (cuDNN)
    instead of the batched GEMM over the unfolded input: the same norms and gradients, C++ and Python."""
    from elasticlab.gns.layers import conv

    torch.manual_seed(5)
    dt = torch.float64 if precision == "fp64" else torch.float32
    model = ConvNet().to("cuda", dt)
    x = torch.randn(6, 4, 33, 31, device="cuda", dtype=dt)

    def run(grouped):
        old = (kernels.USE_CXX_AUTOGRAD, conv.GROUPED_ON_CUDA)
        kernels.USE_CXX_AUTOGRAD, conv.GROUPED_ON_CUDA = cxx, grouped
        try:
            model.zero_grad(set_to_none=True)
            with PerSampleGradNorms(model, loss_reduction="sum") as n:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    out = model(x)
                out.float().pow(2).sum().backward()
            return n.param_sq_norms(), {k: p.grad.clone() for k, p in model.named_parameters()}
        finally:
            kernels.USE_CXX_AUTOGRAD, conv.GROUPED_ON_CUDA = old

    got, g1 = run(True)
    ref, g2 = run(False)
    tol = dict(rtol=1e-9, atol=1e-10) if precision == "fp64" else dict(rtol=2e-3, atol=1e-4)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **tol)
    # Under bf16 autocast cuDNN's grouped convolution writes each example's weight gradient in bfloat16 before
    # the sum, the batched GEMM in float32: the gradients may differ by one bfloat16 rounding (2^-8 relative;
    # seen on the H100: 3.8e-3 on 4 of 108 elements). The norms, accumulated in float32, keep the tight bound.
    gtol = dict(rtol=2 ** -7, atol=1e-4) if precision == "bf16" else tol
    for k in g2:
        torch.testing.assert_close(g1[k], g2[k], **gtol)
