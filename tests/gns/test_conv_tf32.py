"""A convolution's float32 per-example GEMMs take TF32 as cuDNN's convolution setting says (its weight
gradient runs so), not torch's matmul setting: the switch, its per-thread mode in ``_C``, the cost model,
and on a GPU the precision the norms come out in."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticlab import _ext
from elasticlab.gns import PerSampleGradNorms, kernels
from elasticlab.gns.form_choice import cuda_prefers_gram

HAS_MODE = _ext.HAS_C and hasattr(_ext._C, "set_tf32_mode")


@pytest.fixture
def cudnn_tf32():
    """Sets cuDNN's TF32 flag (the legacy switch, which sets convolutions and RNNs alike) and restores it."""
    before = torch.backends.cudnn.allow_tf32
    yield lambda on: setattr(torch.backends.cudnn, "allow_tf32", on)
    torch.backends.cudnn.allow_tf32 = before


def test_conv_tf32_follows_cudnns_setting_not_the_matmul_one(cudnn_tf32):
    matmul = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        cudnn_tf32(True)
        assert kernels.conv_tf32()
        cudnn_tf32(False)
        assert not kernels.conv_tf32()
        torch.backends.cuda.matmul.allow_tf32 = True
        assert not kernels.conv_tf32()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


@pytest.mark.skipif(not HAS_MODE, reason="elasticlab._C not built")
def test_the_thread_mode_is_set_and_restored():
    assert _ext.set_tf32_mode(-1) == -1                   # the default: torch's matmul setting
    with kernels.tf32_mode(True):
        assert _ext.set_tf32_mode(1) == 1
        with kernels.tf32_mode(False):
            assert _ext.set_tf32_mode(0) == 0
        assert _ext.set_tf32_mode(1) == 1
    assert _ext.set_tf32_mode(-1) == -1
    with pytest.raises(ValueError, match="expected -1 .*, 0 or 1, got 7"):
        _ext.set_tf32_mode(7)
    assert _ext.set_tf32_mode(-1) == -1                   # a refused mode changes nothing


@pytest.mark.skipif(not HAS_MODE, reason="elasticlab._C not built")
def test_the_mode_is_per_thread():
    import threading

    seen = []
    with kernels.tf32_mode(True):
        t = threading.Thread(target=lambda: seen.append(_ext.set_tf32_mode(-1)))
        t.start()
        t.join()
        assert _ext.set_tf32_mode(1) == 1
    assert seen == [-1]


def test_the_cost_model_prices_float32_gemms_at_the_layers_precision():
    """T=128, Din=576, Dout=128 (a 3×3 convolution of 64 channels on 8×16 positions): at float32's GEMM rate
    the Gram form's 2·T²·(Din+Dout) FLOPs cost more than the outer form's products, at TF32's less."""
    args = (128, 576, 128, torch.float32, True, False, 64)
    assert not cuda_prefers_gram(*args, tf32=False)
    assert cuda_prefers_gram(*args, tf32=True)
    matmul = torch.backends.cuda.matmul.allow_tf32
    try:
        for on in (False, True):                        # None: torch's matmul setting (a Linear's GEMMs)
            torch.backends.cuda.matmul.allow_tf32 = on
            assert cuda_prefers_gram(*args) == on
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
    assert cuda_prefers_gram(*args[:3], torch.bfloat16, *args[4:], tf32=False) == \
        cuda_prefers_gram(*args[:3], torch.bfloat16, *args[4:], tf32=True)        # no effect on half inputs


def _norms_of_a_constant_input(cxx: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of a Conv2d whose input is 1 + 2^-12 everywhere (exact in float32; TF32's 10-bit mantissa rounds
    it to 1) with an all-ones output gradient: every per-example weight-gradient entry is a count of input
    positions times that value, exact in float32. Returns (norms, exact norms in float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, bias=False)).cuda()
    x = torch.full((4, 64, 32, 32), 1 + 2 ** -12, device="cuda")
    old = kernels.USE_CXX_AUTOGRAD
    kernels.USE_CXX_AUTOGRAD = cxx
    try:
        with PerSampleGradNorms(model, loss_reduction="sum") as n:
            model(x).sum().backward()
    finally:
        kernels.USE_CXX_AUTOGRAD = old
    ones = torch.ones(1, 1, 32, 32, dtype=torch.float64, device="cuda")
    counts = torch.nn.grad.conv2d_weight(ones, (1, 1, 3, 3), ones, padding=1)      # positions under each tap
    exact = (counts * (1 + 2 ** -12)).pow(2).sum() * 64 * 64                   # all 64×64 channel pairs alike
    return n.sq_norms(), exact.expand(4)


@pytest.mark.gpu
@pytest.mark.parametrize("cxx", [True, False])
def test_cuda_float32_conv_norms_take_tf32_as_cudnn_says(cudnn_tf32, cxx):
    matmul = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False    # the matmul setting must not decide
        cudnn_tf32(False)
        got, exact = _norms_of_a_constant_input(cxx)
        # exact entries; only the fold's float32 squares and sums round (≤ 1e-6 over 36864 entries)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=0)
        cudnn_tf32(True)
        got, exact = _norms_of_a_constant_input(cxx)
        rel = (got.double() / exact - 1).abs()
        # TF32 inputs: 1 + 2^-12 read as 1, so ‖G_b‖² is short by (1 + 2^-12)^-2 − 1 ≈ −4.9e-4
        assert bool(((rel > 2e-4) & (rel < 1e-3)).all()), rel.tolist()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
