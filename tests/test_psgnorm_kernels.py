"""The compiled kernels (torch.ops.elasticlab.*) against the PyTorch reference path, CPU and CUDA."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from elasticlab import _ext
from elasticlab.gns import PerSampleGradNorms, kernels
from elasticlab.gns.rules import layernorm_stats

OPS = ["seq_linear_gram_norms", "seq_linear_outer_norms", "layernorm_per_example"]


def seq(B, T, din, dout, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + din + dout)
    a = torch.randn(B, T, din, generator=g, dtype=dtype)
    d = torch.randn(B, T, dout, generator=g, dtype=dtype)
    return a.to(device), d.to(device)


def test_kernels_are_registered_on_cpu():
    for op in OPS:
        assert _ext.has_kernel(op, "cpu"), op


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 140), din=st.integers(1, 40), dout=st.integers(1, 40))
def test_gram_equals_outer_equals_reference(B, T, din, dout):
    a, d = seq(B, T, din, dout)
    want, want_grad = kernels.seq_linear_outer_norms_ref(a, d, with_grad=True)
    torch.testing.assert_close(kernels.seq_linear_gram_norms_ref(a, d), want)            # Gram = outer
    torch.testing.assert_close(kernels.seq_linear_gram_norms(a, d, use_kernel=True), want)
    n, g = kernels.seq_linear_outer_norms(a, d, with_grad=True, use_kernel=True)
    torch.testing.assert_close(n, want)
    torch.testing.assert_close(g, want_grad)
    torch.testing.assert_close(g, d.reshape(-1, dout).t() @ a.reshape(-1, din))          # the weight gradient
    n2, g2 = kernels.seq_linear_outer_norms(a, d, with_grad=False, use_kernel=True)
    assert g2 is None
    torch.testing.assert_close(n2, want)


@pytest.mark.parametrize("shape", [(3, 200, 64, 300), (40, 5, 8, 6), (2, 17, 1100, 3)])
def test_outer_kernel_tiling_paths(shape):
    """Many row tiles, few small tiles (batch-parallel path), and very wide inputs."""
    a, d = seq(*shape)
    want, want_grad = kernels.seq_linear_outer_norms_ref(a, d, with_grad=True)
    n, g = kernels.seq_linear_outer_norms(a, d, with_grad=True, use_kernel=True)
    torch.testing.assert_close(n, want)
    torch.testing.assert_close(g, want_grad)


def test_kernels_accept_strided_inputs_and_float32():
    a, d = seq(4, 33, 12, 7, dtype=torch.float32)
    at = a.transpose(1, 2).contiguous().transpose(1, 2)            # same values, column-major per example
    want = kernels.seq_linear_outer_norms_ref(a.double(), d.double())[0].float()
    got_gram = kernels.seq_linear_gram_norms(at, d, use_kernel=True)
    got_outer = kernels.seq_linear_outer_norms(at, d, use_kernel=True)[0]
    torch.testing.assert_close(got_gram, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_outer, want, rtol=1e-5, atol=0)


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 30), D=st.integers(1, 600))
def test_layernorm_kernel_matches_reference(B, T, D):
    x, d = seq(B, T, D, D)
    x = 2 * x + 0.5
    mean, rstd = layernorm_stats(x, 1e-5)
    want = kernels.layernorm_per_example_ref(x, d, mean, rstd)
    got = kernels.layernorm_per_example(x, d, mean, rstd, use_kernel=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_kernel_errors_name_the_shapes():
    a, d = seq(2, 3, 4, 5)
    with pytest.raises(RuntimeError, match=r"disagree on \(B,T\)"):
        torch.ops.elasticlab.seq_linear_gram_norms(a, d[:, :2])
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.elasticlab.seq_linear_outer_norms(a, d.float(), True)
    with pytest.raises(RuntimeError, match="expected float32 or float64"):
        torch.ops.elasticlab.seq_linear_gram_norms(a.long(), d.long())
    with pytest.raises(RuntimeError, match="expected mean and rstd"):
        torch.ops.elasticlab.layernorm_per_example(a, a, a[:, :, 0], a[:, :2, 0])
    with pytest.raises(ValueError, match=r"shapes \(2, 3\)"):
        kernels.seq_linear_gram_norms(a[:, :, 0], d)


def test_reference_path_when_kernels_are_off(monkeypatch):
    a, d = seq(3, 9, 5, 4)
    monkeypatch.setattr(kernels, "USE_KERNELS", False)
    torch.testing.assert_close(kernels.seq_linear_gram_norms(a, d), kernels.seq_linear_gram_norms_ref(a, d))


# ---------------------------------------------------------------------------------------------- CUDA
def _cuda_vs_cpu(dtype, rtol):
    for shape in [(3, 130, 70, 45), (2, 1, 5, 3), (5, 64, 256, 1024), (8, 512, 64, 16)]:
        a, d = seq(*shape, dtype=torch.float64)
        want, want_grad = kernels.seq_linear_outer_norms_ref(a, d, with_grad=True)
        ac, dc = a.to("cuda", dtype), d.to("cuda", dtype)
        got = kernels.seq_linear_gram_norms(ac, dc, use_kernel=True).cpu().double()
        torch.testing.assert_close(got, want, rtol=rtol, atol=0)
        n, g = kernels.seq_linear_outer_norms(ac, dc, with_grad=True, use_kernel=True)
        torch.testing.assert_close(n.cpu().double(), want, rtol=rtol, atol=0)
        torch.testing.assert_close(g.cpu().double(), want_grad, rtol=rtol, atol=rtol * want_grad.abs().max())
    for B, T, D in [(3, 7, 5), (4, 300, 1000), (1, 1, 33)]:
        x, d = seq(B, T, D, D, dtype=torch.float64)
        mean, rstd = layernorm_stats(x, 1e-5)
        want = kernels.layernorm_per_example_ref(x, d, mean, rstd)
        args = [t.to("cuda", dtype) for t in (x, d, mean, rstd)]
        got = kernels.layernorm_per_example(*args, use_kernel=True)
        for gg, w in zip(got, want):
            torch.testing.assert_close(gg.cpu().double(), w, rtol=rtol, atol=rtol * w.abs().max())


@pytest.mark.gpu
def test_cuda_kernels_registered():
    for op in OPS + ["row_sq_norms"]:
        assert _ext.has_kernel(op, "cuda"), op


@pytest.mark.gpu
def test_cuda_kernels_match_cpu_reference_float64():
    _cuda_vs_cpu(torch.float64, 1e-10)


@pytest.mark.gpu
def test_cuda_kernels_match_cpu_reference_float32():
    _cuda_vs_cpu(torch.float32, 2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_cuda_model_norms_match_cpu(fused):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16)).double()
    x = torch.randn(6, 40, 16, dtype=torch.float64)
    out = {}
    for dev in ("cpu", "cuda"):
        m = model.to(dev)
        m.zero_grad()
        with PerSampleGradNorms(m, fused=fused) as n:
            m(x.to(dev)).pow(2).mean().backward()
        out[dev] = (n.sq_norms().cpu(), [p.grad.cpu() for p in m.parameters()])
    torch.testing.assert_close(out["cuda"][0], out["cpu"][0], rtol=1e-10, atol=0)
    for g1, g2 in zip(out["cuda"][1], out["cpu"][1]):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_kernels_with_inputs_that_require_grad():
    """The BLAS calls inside the kernels run on worker threads: inputs requiring grad must not trip them."""
    a, d = seq(12, 4, 8, 3)
    a.requires_grad_(True)
    want = kernels.seq_linear_outer_norms_ref(a.detach(), d)[0]
    torch.testing.assert_close(kernels.seq_linear_outer_norms(a, d, with_grad=True)[0], want)
    torch.testing.assert_close(kernels.seq_linear_gram_norms(a, d), want)
