"""The implicit-GEMM Triton convolution kernel (``elasticlab.gns.triton_conv``) against float64.

Like ``test_triton_outer.py`` it runs on a CUDA device, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, CI's ``.ci/triton_interpret.sh``); ``make test``'s CPU torch has no Triton and skips
it. The reference is each example's weight gradient by ``torch.nn.grad.conv{1,2}d_weight`` in float64, of the
same (already rounded) inputs. Cases cover the addressing: zero padding at every edge, stride, dilation,
non-square kernels, 1×1 kernels, Conv1d, output positions past one K step, examples split over the second grid
axis, channels-last and strided inputs, and the norms-only launch. The model-level test sends a small CNN
through the layer rule with :data:`elasticlab.gns.layers.conv.TRITON_ON_CUDA` on and compares its norms and
gradients with the default path's.
"""
import pytest
import torch
from torch import nn

from elasticlab.gns import triton_conv, triton_launch, triton_outer

DEV = triton_launch.kernel_device() or pytest.skip(
    "the Triton kernels need Triton and a CUDA device, or TRITON_INTERPRET=1", allow_module_level=True)
INTERPRET = triton_launch.INTERPRETED
pytestmark = [] if INTERPRET else [pytest.mark.gpu]
DTYPES = triton_launch.kernel_dtypes()
SMALL = (32, 32, 16, 4, 2)                     # small tiles: several tiles and K steps on small layers


@pytest.fixture(autouse=True)
def _exact_float32_convolutions():
    """float32 cases are held to float64 at 2e-5: exact products. The kernel multiplies float32 as cuDNN's
    convolution setting says (TF32 by default), so that setting is off here."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before

# (conv, B, spatial input size, config)
CASES = [
    (lambda: nn.Conv2d(3, 5, 3, padding=1), 3, (6, 7), None),                      # padding at every edge
    (lambda: nn.Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0), dilation=(1, 2)), 5, (9, 10), SMALL),
    (lambda: nn.Conv2d(2, 3, 1, bias=False), 9, (4, 4), SMALL),                     # 1×1; split over examples
    (lambda: nn.Conv2d(5, 40, 3, stride=(1, 2), padding=2), 2, (11, 8), SMALL),     # Cout over one tile
    (lambda: nn.Conv1d(3, 4, 5, padding=2), 4, (33,), None),                        # Conv1d, T past BK
    (lambda: nn.Conv1d(6, 2, 3, stride=3, dilation=2), 3, (40,), SMALL),
]
IDS = ["pad", "stride-dil", "1x1-split", "wide", "conv1d", "conv1d-stride"]


def _reference(conv, x, d):
    """(‖G_b‖² (B,), Σ_b G_b) in float64 from each example's weight gradient."""
    grad_w = torch.nn.grad.conv1d_weight if isinstance(conv, nn.Conv1d) else torch.nn.grad.conv2d_weight
    x64, d64 = x.double().cpu(), d.double().cpu()
    per = [grad_w(x64[b:b + 1], conv.weight.shape, d64[b:b + 1], conv.stride, conv.padding, conv.dilation)
           for b in range(x.shape[0])]
    return torch.stack([g.pow(2).sum() for g in per]), sum(per)


def _inputs(conv, B, size, dtype, channels_last=False):
    g = torch.Generator().manual_seed(B * 100 + sum(size))
    x = torch.randn(B, conv.in_channels, *size, generator=g)
    with torch.no_grad():
        out_size = conv(x.to(conv.weight.device)).shape[2:]
    d = torch.randn(B, conv.out_channels, *out_size, generator=g) / out_size.numel() ** 0.5
    x, d = x.to(DEV, dtype), d.to(DEV, dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, d


def _check(conv, x, d, config, with_grad=True):
    n, g = triton_conv.conv_outer_norms(conv, x, d, with_grad, config)
    rn, rg = _reference(conv, x, d)
    assert n.dtype == torch.float32 and n.shape == (x.shape[0],)
    torch.testing.assert_close(n.double().cpu(), rn, rtol=2e-5, atol=1e-6 * float(rn.max()))
    if with_grad:
        assert g.dtype == torch.float32 and g.shape == conv.weight.shape
        torch.testing.assert_close(g.double().cpu(), rg, rtol=2e-5, atol=2e-5 * float(rg.abs().max()))
    else:
        assert g is None
    return n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make,B,size,config", CASES, ids=IDS)
def test_conv_norms_match_float64(make, B, size, config, dtype):
    torch.manual_seed(0)
    conv = make().to(DEV)
    x, d = _inputs(conv, B, size, dtype)
    n = _check(conv, x, d, config)
    torch.testing.assert_close(_check(conv, x, d, config, with_grad=False), n, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channels_last_and_strided_inputs(dtype):
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, padding=1).to(DEV)
    x, d = _inputs(conv, 3, (7, 9), dtype, channels_last=True)
    assert not x.is_contiguous()
    _check(conv, x, d, SMALL)
    wide = torch.randn(3, 4, 7, 12).to(DEV, dtype)              # a view: rows 12 apart, columns 2..10
    _check(conv, wide[..., 2:11], d, SMALL)


def test_empty_batch_and_unsupported_layers():
    conv = nn.Conv2d(2, 3, 3).to(DEV)
    n, g = triton_conv.conv_outer_norms(conv, torch.zeros(0, 2, 5, 5, device=DEV),
                                        torch.zeros(0, 3, 3, 3, device=DEV), True)
    assert n.shape == (0,) and g.shape == conv.weight.shape and not g.any()
    like = torch.empty(0, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    assert not triton_conv.supported(nn.Conv2d(4, 4, 3, groups=2), like)                   # groups
    assert not triton_conv.supported(nn.Conv2d(4, 4, 3, padding="same"), like)            # string padding
    assert not triton_conv.supported(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), like)
    assert not triton_conv.supported(nn.Linear(4, 4), like)
    with pytest.raises(ValueError, match=r"in_channels=2\) got an input of shape \(2, 5, 5, 5\)"):
        triton_conv.conv_outer_norms(conv, torch.zeros(2, 5, 5, 5, device=DEV), torch.zeros(2, 3, 3, 3), True)
    with pytest.raises(ValueError, match=r"output gradient of shape \(2, 3, 4, 4\), expected \(2, 3, 3, 3\)"):
        triton_conv.conv_outer_norms(conv, torch.zeros(2, 2, 5, 5, device=DEV),
                                     torch.zeros(2, 3, 4, 4, device=DEV), True)


def test_model_norms_with_the_triton_kernel_match_the_default_path(monkeypatch):
    """A small CNN under PerSampleGradNorms (fused) with TRITON_ON_CUDA on: its convolutions go to the kernel,
    and the norms and gradients equal those of the default path. Under the interpreter the layers' CPU
    tensors are let in by patching ``supported``'s device check."""
    from elasticlab.gns.layers import conv as conv_rule

    if INTERPRET:
        monkeypatch.setattr(triton_outer, "supported", lambda a: a.dtype in (torch.float16, torch.float32))
    calls = []
    real = triton_conv.conv_outer_norms
    monkeypatch.setattr(triton_conv, "conv_outer_norms", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(),
                          nn.Flatten(), nn.Linear(16 * 4 * 4, 5)).to(DEV)
    x = torch.randn(6, 3, 10, 10, device=DEV)
    out = {}
    before = torch.backends.cuda.matmul.allow_tf32        # (a property of torch's cuBLAS settings)
    torch.backends.cuda.matmul.allow_tf32 = False          # exact float32 on both paths (the Linear's; the
    #                                                        convolutions' follow cuDNN's setting, off here)
    try:
        _both_paths(monkeypatch, conv_rule, model, x, out, calls)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-4, atol=0)
    for g1, g0 in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)


def _both_paths(monkeypatch, conv_rule, model, x, out, calls):
    from elasticlab.gns import PerSampleGradNorms, form_choice

    # The outer form for both convolutions, so that the switch sends both to the kernel: on CUDA the cost
    # model takes the Gram form for the second one (L = 16 positions against K·Cout = 1152).
    monkeypatch.setattr(form_choice, "use_gram", lambda *a, **k: False)
    for on in (False, True):
        monkeypatch.setattr(conv_rule, "TRITON_ON_CUDA", on)
        monkeypatch.setattr(triton_outer, "FP32", True)
        model.zero_grad(set_to_none=True)
        with PerSampleGradNorms(model) as psg:
            model(x).pow(2).mean().backward()
            out[on] = (psg.sq_norms(), [p.grad.clone() for p in model.parameters()])
        assert len(calls) == (2 if on else 0)                      # both convolutions, then none
