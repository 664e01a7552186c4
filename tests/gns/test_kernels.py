"""The compiled kernels (torch.ops.elasticlab.*) against the PyTorch reference path, CPU and CUDA."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from elasticlab import _ext
from elasticlab.gns import PerSampleGradNorms, form_choice, kernels
from elasticlab.gns.layers.layernorm import layernorm_stats

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


def _row_sq_out_checks(device):
    x = torch.randn(5, 3, 4, dtype=torch.float64, device=device)
    buf = torch.full((2, 5), float("nan"), dtype=torch.float64, device=device)
    got = torch.ops.elasticlab.row_sq_norms.out(x, out=buf[1])           # a row of a (2, B) buffer
    assert got.data_ptr() == buf[1].data_ptr()
    torch.testing.assert_close(buf[1], x.pow(2).sum((1, 2)), rtol=1e-12, atol=0)
    assert buf[0].isnan().all()
    col = torch.full((5, 2), float("nan"), dtype=torch.float32, device=device)
    xb = torch.randn(5, 7, device=device).bfloat16()                        # half rows: a float32 out
    torch.ops.elasticlab.row_sq_norms.out(xb, out=col[:, 1])               # stride 2
    torch.testing.assert_close(col[:, 1], xb.float().pow(2).sum(1), rtol=1e-6, atol=0)
    assert col[:, 0].isnan().all()
    with pytest.raises(RuntimeError, match="out must be Double for Double rows, got Float"):
        torch.ops.elasticlab.row_sq_norms.out(x, out=torch.empty(5, device=device))
    with pytest.raises(RuntimeError, match=r"out must be \(5,\)"):
        torch.ops.elasticlab.row_sq_norms.out(x, out=torch.empty(4, dtype=torch.float64, device=device))
    assert torch.ops.elasticlab.row_sq_norms(torch.empty(0, 3, 4, device=device)).shape == (0,)    # no rows


def test_row_sq_out_writes_into_a_strided_row():
    _row_sq_out_checks("cpu")


@pytest.mark.gpu
def test_cuda_row_sq_out_writes_into_a_strided_row():
    _row_sq_out_checks("cuda")


def _product_checks(device):
    """product_norms.out: row 0 ‖a_b‖²‖d_b‖², row 1 ‖d_b‖², into a (2, B) buffer of any strides."""
    op = torch.ops.elasticlab.product_norms.out
    for B, din, dout in ((5, 3, 4), (1, 1, 1), (3, 700, 1), (0, 4, 4)):
        a = torch.randn(B, din, dtype=torch.float64, device=device)
        d = torch.randn(B, dout, dtype=torch.float64, device=device)
        buf = torch.full((2, B), float("nan"), dtype=torch.float64, device=device)
        assert op(a, d, out=buf).data_ptr() == buf.data_ptr()
        want_d = d.pow(2).sum(1)
        torch.testing.assert_close(buf[1], want_d, rtol=1e-12, atol=0)
        torch.testing.assert_close(buf[0], a.pow(2).sum(1) * want_d, rtol=1e-12, atol=0)
    # half rows (non-contiguous a: a column slice) into a float32 column-major buffer
    a = torch.randn(6, 9, device=device).bfloat16()[:, 1:8]
    d = torch.randn(6, 33, device=device).half().bfloat16()
    col = torch.full((6, 2), float("nan"), dtype=torch.float32, device=device).t()        # strides (1, 2)
    op(a, d, out=col)
    want_d = d.float().pow(2).sum(1)
    torch.testing.assert_close(col[1], want_d, rtol=1e-5, atol=0)
    torch.testing.assert_close(col[0], a.float().pow(2).sum(1) * want_d, rtol=1e-5, atol=0)
    a, d = torch.randn(5, 3, device=device), torch.randn(5, 4, device=device)
    with pytest.raises(RuntimeError, match="out must be Float for Float rows, got Double"):
        op(a, d, out=torch.empty(2, 5, dtype=torch.float64, device=device))
    with pytest.raises(RuntimeError, match=r"out must be \(2, 5\), got \[5\]"):
        op(a, d, out=torch.empty(5, device=device))
    with pytest.raises(RuntimeError, match=r"\(B,Dout\), got shapes \[5, 3\] and \[4, 4\]"):
        op(a, d[:4], out=torch.empty(2, 5, device=device))
    with pytest.raises(RuntimeError, match="one floating dtype, got Float and Double"):
        op(a, d.double(), out=torch.empty(2, 5, device=device))


def _product_bias_checks(device):
    """product_bias_norms: the rows of product_norms.out, and the bias gradient Σ_b d_b returned in the rows'
    accumulation dtype (one CUDA launch: its column blocks follow the row blocks)."""
    op = torch.ops.elasticlab.product_bias_norms
    for B, din, dout in ((5, 3, 4), (1, 1, 1), (3, 7, 700), (300, 2, 5), (0, 4, 4)):
        a = torch.randn(B, din, dtype=torch.float64, device=device)
        d = torch.randn(B, dout, dtype=torch.float64, device=device)
        buf = torch.full((2, B), float("nan"), dtype=torch.float64, device=device)
        gb = op(a, d, buf)
        want_d = d.pow(2).sum(1)
        torch.testing.assert_close(buf[1], want_d, rtol=1e-12, atol=0)
        torch.testing.assert_close(buf[0], a.pow(2).sum(1) * want_d, rtol=1e-12, atol=0)
        assert gb.shape == (dout,) and gb.dtype == torch.float64
        torch.testing.assert_close(gb, d.sum(0), rtol=1e-12, atol=1e-12)
    a = torch.randn(6, 9, device=device).bfloat16()[:, 1:8]                  # half rows, a column slice
    d = torch.randn(6, 33, device=device).bfloat16()
    col = torch.full((6, 2), float("nan"), dtype=torch.float32, device=device).t()
    gb = op(a, d, col)
    assert gb.dtype == torch.float32
    torch.testing.assert_close(gb, d.float().sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(col[1], d.float().pow(2).sum(1), rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError, match=r"out must be \(2, 6\), got \[2, 5\]"):
        op(a, d, torch.empty(2, 5, device=device))


def test_product_bias_norms_write_the_rows_and_sum_the_bias():
    _product_bias_checks("cpu")


@pytest.mark.gpu
def test_cuda_product_bias_norms_write_the_rows_and_sum_the_bias():
    _product_bias_checks("cuda")


def _batch_sum_checks(device):
    """batch_sum_norms: Σ_b x_b returned and |x_b|^2 written into a strided buffer row, the other row left as
    it was (one CUDA launch: the affine finish kernel with one array); bad arguments named."""
    op = torch.ops.elasticlab.batch_sum_norms
    for B, D in ((5, 3), (1, 1), (3, 700), (300, 2), (0, 4), (4, 0)):
        x = torch.randn(B, D, dtype=torch.float64, device=device)
        buf = torch.full((B, 2), float("nan"), dtype=torch.float64, device=device).t()
        gb = op(x, buf[1])
        assert gb.shape == (D,) and gb.dtype == torch.float64
        torch.testing.assert_close(gb, x.sum(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(buf[1], x.pow(2).sum(1), rtol=1e-12, atol=0)
        assert buf[0].isnan().all()
    x = torch.randn(7, 40, device=device)[:, ::2]                              # float32, non-contiguous
    row = torch.full((7,), float("nan"), device=device)
    torch.testing.assert_close(op(x, row), x.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row, x.pow(2).sum(1), rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError, match=r"norms must be \(7\), got \[6\]"):
        op(x, row[:6])
    with pytest.raises(RuntimeError, match="float32 or float64 x .*got BFloat16"):
        op(x.bfloat16(), row)
    with pytest.raises(RuntimeError, match=r"x \(B, D\), got shape \[7, 2, 10\]"):
        op(x.reshape(7, 2, 10), row)
    with pytest.raises(RuntimeError, match="norms must be Double for Double inputs, got Float"):
        op(x.double(), row)


def test_batch_sum_norms_sum_and_write_a_row():
    _batch_sum_checks("cpu")


@pytest.mark.gpu
def test_cuda_batch_sum_norms_sum_and_write_a_row():
    _batch_sum_checks("cuda")


def _outer_out_checks(device):
    """seq_linear_outer_norms.out: the norms into a given (B,) row (strided: a row of a (B, 2) buffer's
    transpose), the gradient returned; the same as the functional form's."""
    op = torch.ops.elasticlab.seq_linear_outer_norms
    f64, bf16 = torch.float64, torch.bfloat16
    for B, T, din, dout, dt in ((3, 5, 4, 6, f64), (2, 1, 1, 1, f64), (0, 3, 2, 2, f64), (4, 9, 8, 5, bf16)):
        a = torch.randn(B, T, din, device=device).to(dt)
        d = torch.randn(B, T, dout, device=device).to(dt)
        acc = torch.float64 if dt == torch.float64 else torch.float32
        buf = torch.full((B, 2), float("nan"), dtype=acc, device=device).t()                 # strides (1, 2)
        g = op.out(a, d, True, norms=buf[0])
        n0, g0 = op(a, d, True)
        torch.testing.assert_close(buf[0], n0, rtol=1e-12, atol=0)
        torch.testing.assert_close(g, g0, rtol=1e-12, atol=0)
        assert buf[1].isnan().all()                                   # the other row untouched
    a, d = torch.randn(3, 4, 5, device=device), torch.randn(3, 4, 2, device=device)
    with pytest.raises(RuntimeError, match=r"norms must be \(3\), got \[2\]"):
        op.out(a, d, True, norms=torch.empty(2, device=device))
    with pytest.raises(RuntimeError, match="norms must be Float for Float inputs, got Double"):
        op.out(a, d, True, norms=torch.empty(3, dtype=torch.float64, device=device))


def test_outer_norms_out_writes_into_a_row():
    _outer_out_checks("cpu")


@pytest.mark.gpu
def test_cuda_outer_norms_out_writes_into_a_row():
    _outer_out_checks("cuda")


def _close(got, want, rtol):
    scale = 1 + (float(want.abs().max()) if want.numel() else 0.0)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * scale)


def _stats(x):
    """(mean, 1/std) over the last dimension (zeros for an empty tensor)."""
    if x.numel() == 0:
        return x.new_zeros(x.shape[:-1]), x.new_zeros(x.shape[:-1])
    var, mean = torch.var_mean(x, -1, correction=0)
    return mean, (var + 1e-5).rsqrt()


def _affine_checks(device):
    """layernorm_affine_norms / groupnorm_affine_norms: the batch sums of the per-example affine gradients
    returned, their squared norms in rows 0 and 1 of a (2, B) buffer of any strides, against float64."""
    ln, gn = torch.ops.elasticlab.layernorm_affine_norms, torch.ops.elasticlab.groupnorm_affine_norms
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 2e-5), (torch.bfloat16, 2e-5)):
        acc = kernels.acc_dtype(dtype)
        for B, T, D in ((4, 70, 33), (1, 1, 1), (3, 300, 5), (0, 4, 6), (2, 0, 3)):
            x = torch.randn(B, T, D, device=device).to(dtype)
            d = torch.randn(B, T, D, device=device).to(dtype)
            mean, rstd = _stats(x.to(acc))
            buf = torch.full((B, 2), float("nan"), dtype=acc, device=device).t()          # strides (1, 2)
            gw, gb = ln(x, d, mean, rstd, buf)
            pw, pb = kernels.layernorm_per_example_ref(x.double(), d.double(), mean.double(), rstd.double())
            for got, want in ((gw, pw.sum(0)), (gb, pb.sum(0)), (buf[0], pw.pow(2).sum(1)),
                              (buf[1], pb.pow(2).sum(1))):
                assert got.dtype == acc
                _close(got, want, rtol)
        for B, C, S, G in ((3, 8, 17, 4), (2, 6, 4, 6), (1, 4, 300, 1), (2, 4, 0, 2), (0, 4, 5, 2)):
            x = torch.randn(B, C, S, device=device).to(dtype) * 3 + 1
            d = torch.randn(B, C, S, device=device).to(dtype)
            mean, rstd = _stats(x.to(acc).reshape(B, G, C // G * S))
            buf = torch.full((2, B), float("nan"), dtype=acc, device=device)
            gw, gb = gn(x, d, mean, rstd, G, buf)
            m64, r64 = mean.double().unsqueeze(-1), rstd.double().unsqueeze(-1)
            xhat = (x.double().reshape(B, G, C // G * S) - m64) * r64
            pw = (d.double() * xhat.reshape(B, C, S)).sum(-1)
            pb = d.double().sum(-1)
            for got, want in ((gw, pw.sum(0)), (gb, pb.sum(0)), (buf[0], pw.pow(2).sum(1)),
                              (buf[1], pb.pow(2).sum(1))):
                assert got.dtype == acc and got.shape == want.shape
                _close(got, want, rtol)
    x = torch.randn(2, 6, 5, device=device)
    m = torch.zeros(2, 3, device=device)
    with pytest.raises(RuntimeError, match="4 groups do not divide C = 6"):
        gn(x, x, m, m, 4, torch.empty(2, 2, device=device))
    with pytest.raises(RuntimeError, match=r"expected mean and rstd \(B,G\) = \(2, 3\), got \[2, 2\]"):
        gn(x, x, m[:, :2], m[:, :2], 3, torch.empty(2, 2, device=device))
    with pytest.raises(RuntimeError, match="groupnorm_affine_norms: d must be Float, got Double"):
        gn(x, x.double(), m, m, 3, torch.empty(2, 2, device=device))
    with pytest.raises(RuntimeError, match="mean and rstd must be Float for Float inputs"):
        gn(x, x, m.double(), m, 3, torch.empty(2, 2, device=device))
    with pytest.raises(RuntimeError, match=r"groupnorm_affine_norms: norms must be \(2, 2\), got \[2, 3\]"):
        gn(x, x, m, m, 3, torch.empty(2, 3, device=device))
    with pytest.raises(RuntimeError, match="layernorm_affine_norms: norms must be Float for Float inputs"):
        ln(x, x, m[:, :1].expand(2, 6).contiguous(), m[:, :1].expand(2, 6).contiguous(),
           torch.empty(2, 2, dtype=torch.float64, device=device))
    if device != "cpu":                               # statistics left on the host: named, not read
        with pytest.raises(RuntimeError, match="groupnorm_affine_norms: x on cuda:0, d, mean and rstd on "
                                               "cuda:0, cpu and cpu"):
            gn(x, x, m.cpu(), m.cpu(), 3, torch.empty(2, 2, device=device))


def test_affine_norms_of_normalisation_layers():
    _affine_checks("cpu")


@pytest.mark.gpu
def test_cuda_affine_norms_of_normalisation_layers():
    _affine_checks("cuda")


def test_product_norms_write_both_rows():
    _product_checks("cpu")


@pytest.mark.gpu
def test_cuda_product_norms_write_both_rows():
    _product_checks("cuda")


def test_kernel_errors_name_the_shapes():
    a, d = seq(2, 3, 4, 5)
    with pytest.raises(RuntimeError, match=r"disagree on \(B,T\)"):
        torch.ops.elasticlab.seq_linear_gram_norms(a, d[:, :2])
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.elasticlab.seq_linear_outer_norms(a, d.float(), True)
    with pytest.raises(RuntimeError, match="expected float64, float32, bfloat16 or float16"):
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
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 3, 5, 7), (600, 2, 16, 8), (70, 4, 1400, 1400)])
def test_cuda_fold_over_example_groups(shape, dtype):
    """The fold's 2-D grid: many examples with small products (groups of examples, each summing its rows of
    the gradient into a scratch), unvectorised widths (5x7), and products chunked across GEMMs (1400x1400
    float32 per example: three chunks, the later ones accumulating into the gradient)."""
    a, d = seq(*shape, dtype=torch.float32)
    a, d = a.to(dtype), d.to(dtype)
    want, want_grad = kernels.seq_linear_outer_norms_ref(a.double(), d.double(), with_grad=True)
    n, g = kernels.seq_linear_outer_norms(a.cuda(), d.cuda(), with_grad=True, use_kernel=True)
    tol = {torch.float64: 1e-10, torch.float32: 2e-4, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(n.cpu().double(), want, rtol=tol, atol=0)
    torch.testing.assert_close(g.cpu().double(), want_grad, rtol=tol, atol=tol * want_grad.abs().max())
    n_only, _ = kernels.seq_linear_outer_norms(a.cuda(), d.cuda(), with_grad=False, use_kernel=True)
    torch.testing.assert_close(n_only, n, rtol=0, atol=0)


class _ConvSeq(nn.Module):
    """Every fused family on one model: Conv2d, GroupNorm, Linear (2-D and sequence), LayerNorm, Embedding."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.emb, self.up, self.ln = nn.Embedding(20, 8), nn.Linear(8, 24), nn.LayerNorm(24)
        self.head = nn.Linear(24, 5)

    def forward(self, img, idx):
        h = F.relu(self.gn(self.conv(img))).mean((2, 3))                  # (B, 8)
        s = self.ln(self.up(self.emb(idx) + h.unsqueeze(1)))               # (B, T, 24)
        return self.head(s.mean(1))


def _model_norms(model, inputs, fused, autocast=None):
    model.zero_grad()
    with PerSampleGradNorms(model, fused=fused) as n:
        with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(*inputs)
        out.pow(2).mean().backward()
    return n.param_sq_norms(), [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_cuda_model_norms_match_cpu(fused):
    """The same float64 model on the CPU and on CUDA (separate copies: moving a model moves its gradients)."""
    import copy
    torch.manual_seed(0)
    cpu_model = _ConvSeq().double()
    cuda_model = copy.deepcopy(cpu_model).cuda()
    img, idx = torch.randn(6, 3, 9, 9, dtype=torch.float64), torch.randint(0, 20, (6, 7))
    want, want_grads = _model_norms(cpu_model, (img, idx), fused)
    got, grads = _model_norms(cuda_model, (img.cuda(), idx.cuda()), fused)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k], rtol=1e-9, atol=1e-14, msg=k)
    for g1, g2 in zip(grads, want_grads):
        torch.testing.assert_close(g1.cpu(), g2, rtol=1e-9, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_kernels_match_float64_reference(dtype):
    """Half inputs, float32 accumulation: against float64 on the same (rounded) inputs; strided operands and
    products chunked across several GEMMs (4096x4096 per example exceeds the scratch budget at B=9)."""
    for shape in [(3, 130, 70, 45), (2, 1, 5, 3), (9, 64, 4096, 4096), (5, 300, 8, 2000)]:
        a, d = seq(*shape, dtype=torch.float32)
        a, d = a.to(dtype), d.to(dtype)
        want, want_grad = kernels.seq_linear_outer_norms_ref(a.double(), d.double(), with_grad=True)
        ac, dc = a.cuda(), d.cuda()
        gram = kernels.seq_linear_gram_norms(ac, dc, use_kernel=True)
        n, g = kernels.seq_linear_outer_norms(ac, dc, with_grad=True, use_kernel=True)
        assert gram.dtype == n.dtype == g.dtype == torch.float32
        torch.testing.assert_close(gram.cpu().double(), want, rtol=1e-4, atol=0)
        # bfloat16 products (outer form): each element rounded once, squares summed in float32
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(n.cpu().double(), want, rtol=tol, atol=0)
        torch.testing.assert_close(g.cpu().double(), want_grad, rtol=tol, atol=tol * want_grad.abs().max())
        at = ac.transpose(1, 2).contiguous().transpose(1, 2)                  # column-major per example
        dt = dc.transpose(1, 2).contiguous().transpose(1, 2)
        n_t = kernels.seq_linear_outer_norms(at, dt, use_kernel=True)[0]
        torch.testing.assert_close(n_t, n, rtol=1e-3, atol=0)
        gram_t = kernels.seq_linear_gram_norms(at, dt, use_kernel=True)
        torch.testing.assert_close(gram_t, gram, rtol=1e-4, atol=0)
    x = torch.randn(5, 33, 700, device="cuda").to(dtype)
    r = kernels.row_sq(x, use_kernel=True)
    assert r.dtype == torch.float32
    torch.testing.assert_close(r.double(), x.double().pow(2).sum((1, 2)), rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.02), (torch.float16, 0.005)])
def test_cuda_autocast_norms_match_fp32(fused, dtype, tol):
    torch.manual_seed(0)
    model = _ConvSeq().cuda()
    img, idx = torch.randn(16, 3, 9, 9, device="cuda"), torch.randint(0, 20, (16, 7), device="cuda")
    ref, _ = _model_norms(model, (img, idx), fused)
    got, grads = _model_norms(model, (img, idx), fused, autocast=dtype)
    tot_ref, tot = sum(ref.values()), sum(got.values())
    assert tot.dtype == torch.float32
    assert float(((tot - tot_ref).abs() / tot_ref).median()) < tol
    assert all(g.dtype == torch.float32 for g in grads)


@pytest.mark.gpu
def test_cuda_compiled_model_norms_equal_eager():
    torch.manual_seed(0)
    # (not LayerNorm last: under a squared loss of LayerNorm's output, its input gradient is pure rounding)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    model = model.cuda()
    x = torch.randn(6, 40, 16, device="cuda")
    want, _ = _model_norms(model, (x,), True)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    model.zero_grad()
    with PerSampleGradNorms(model) as n:
        compiled(x).pow(2).mean().backward()
    for k, v in n.param_sq_norms().items():
        torch.testing.assert_close(v, want[k], rtol=1e-4, atol=0, msg=k)


def test_kernels_with_inputs_that_require_grad():
    """The BLAS calls inside the kernels run on worker threads: inputs requiring grad must not trip them."""
    a, d = seq(12, 4, 8, 3)
    a.requires_grad_(True)
    want = kernels.seq_linear_outer_norms_ref(a.detach(), d)[0]
    torch.testing.assert_close(kernels.seq_linear_outer_norms(a, d, with_grad=True)[0], want)
    torch.testing.assert_close(kernels.seq_linear_gram_norms(a, d), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_triton_fused_outer_matches_float64(dtype):
    """The fused tensor-core kernel: tile edges, one tile with the examples split over programs, strided
    (unfolded-convolution) operands, and the dispatch that sends half-precision CUDA inputs to it."""
    from elasticlab.gns import triton_outer
    if not triton_outer.HAS_TRITON:
        pytest.skip("triton not importable")
    for shape in [(3, 130, 70, 45), (40, 5, 8, 6), (2, 1, 300, 129), (4, 200, 768, 2304)]:
        a, d = seq(*shape, dtype=torch.float32)
        a, d = a.to(dtype).cuda(), d.to(dtype).cuda()
        want, want_grad = kernels.seq_linear_outer_norms_ref(a.double(), d.double(), with_grad=True)
        n, g = triton_outer.outer_norms(a, d, True)
        assert n.dtype == g.dtype == torch.float32
        torch.testing.assert_close(n.double(), want, rtol=1e-4, atol=0)
        torch.testing.assert_close(g.double(), want_grad, rtol=1e-4, atol=1e-4 * want_grad.abs().max())
        at = a.transpose(1, 2).contiguous().transpose(1, 2)
        torch.testing.assert_close(triton_outer.outer_norms(at, d, False)[0], n, rtol=1e-5, atol=0)
        n2, _ = kernels.seq_linear_outer_norms(a, d, with_grad=True)             # dispatch by measured shape
        if triton_outer.preferred(a, d):
            torch.testing.assert_close(n2, n, rtol=0, atol=0)                      # the fused kernel itself
        else:
            torch.testing.assert_close(n2.double(), want, rtol=1e-2, atol=0)      # cuBLAS, bf16 products


@pytest.mark.gpu
def test_cuda_fused_bias_sums_match_the_sums_apart(monkeypatch):
    """triton_outer.FUSE_BIAS: a bf16 sequence MLP whose Linear layers the Triton kernel serves (T ≤ 128) gets
    the same norms and gradients, bias included, whether each example's bias gradient is summed in the kernel
    or by a pass over δ after it; and the kernel's sums match float64 on shapes with cut tiles."""
    from torch import nn

    from elasticlab.gns import PerSampleGradNorms, triton_outer, triton_tune
    if not triton_outer.HAS_TRITON:
        pytest.skip("triton not importable")
    monkeypatch.setattr(triton_outer, "FUSE_BIAS", True)
    for shape in [(3, 130, 72, 48), (4, 200, 768, 2304)]:
        a, d = (t.to(torch.bfloat16).cuda() for t in seq(*shape, dtype=torch.float32))
        for cfg in (None, (128, 128, 64, 8, 4, True, True), (128, 128, 64, 8, 4, False, True, True)):
            _, _, db = triton_outer.outer_norms(a, d, True, cfg, bias=True)
            want = d.double().sum(1)
            torch.testing.assert_close(db.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    x = torch.randn(8, 100, 256, device="cuda")
    out = {}
    monkeypatch.setattr(triton_tune, "ENABLED", False)     # untuned: FUSE_BIAS alone says which way
    for fused in (False, True):
        monkeypatch.setattr(triton_outer, "FUSE_BIAS", fused)
        model.zero_grad(set_to_none=True)
        with PerSampleGradNorms(model) as psg:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            out[fused] = (psg.param_sq_norms(), [p.grad.clone() for p in model.parameters()])
    for k, v in out[True][0].items():
        torch.testing.assert_close(v, out[False][0][k], rtol=1e-4, atol=0, msg=k)
    for g1, g0 in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_cuda_backward_makes_no_host_sync(autocast):
    """Forward and backward with norms never wait on the GPU (torch.cuda sync debug mode raises on a sync):
    every fused family, the embedding's segment sums and both outer-product paths."""
    torch.manual_seed(0)
    model = _ConvSeq().cuda()
    img, idx = torch.randn(16, 3, 9, 9, device="cuda"), torch.randint(0, 20, (16, 7), device="cuda")
    _model_norms(model, (img, idx), True, autocast=autocast)                  # warm-up: lazy init may sync
    model.zero_grad()
    with PerSampleGradNorms(model) as n:
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(img, idx)
            out.pow(2).mean().backward()
            total = n.sq_norms()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(total).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_scratch_budget_sets_the_chunks(dtype):
    """``form_choice.scratch_cap`` moves the CUDA forms' chunk budget: a 1 MB budget splits 7 examples of
    300x400 float32 products (0.48 MB each) into chunks of two (Gram: 2·60²·4 bytes, all in one), and the
    norms and gradient equal the one-chunk ones up to summation order (and, for bfloat16 products, a rounding
    of a product element that another GEMM algorithm may flip: 1e-3)."""
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    a, d = seq(7, 60, 300, 400, dtype=torch.float32)
    ac, dc = a.to(dtype).cuda(), d.to(dtype).cuda()
    n1, g1 = kernels.seq_linear_outer_norms(ac, dc, with_grad=True, use_kernel=True)
    gram1 = kernels.seq_linear_gram_norms(ac, dc, use_kernel=True)
    with form_choice.scratch_cap(1 << 20):
        n, g = kernels.seq_linear_outer_norms(ac, dc, with_grad=True, use_kernel=True)
        gram = kernels.seq_linear_gram_norms(ac, dc, use_kernel=True)
    with form_choice.scratch_cap(1):                                # one example a chunk
        n_one, g_one = kernels.seq_linear_outer_norms(ac, dc, with_grad=True, use_kernel=True)
    for got, grad in ((n, g), (n_one, g_one)):
        torch.testing.assert_close(got, n1, rtol=tol, atol=0)
        torch.testing.assert_close(grad, g1, rtol=tol, atol=tol * float(g1.abs().max()))
    torch.testing.assert_close(gram, gram1, rtol=1e-6, atol=0)
