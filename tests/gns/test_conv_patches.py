"""The im2col operator ``elasticlab::conv_patches`` (csrc/cpu/patches.cpp, csrc/cuda/patches.cu) against the
strided-view reference :func:`elasticlab.gns.kernels.conv_patches_ref`, and its errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticlab.gns import kernels

pytestmark = pytest.mark.skipif(not kernels.compiled("conv_patches", torch.empty(0)),
                                reason="elasticlab._C not built")

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _input(B, C, spatial, layout, dtype, device="cpu"):
    x = torch.randn(B, C, *spatial, dtype=torch.float64).to(dtype)
    if layout == "channels_last" and len(spatial) == 2:
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":                         # every other channel and column: no unit stride
        x = torch.randn(B, 2 * C, *spatial[:-1], 2 * spatial[-1], dtype=torch.float64).to(dtype)
        x = x[:, ::2, ..., ::2]
    return x.to(device)


@settings(max_examples=60, deadline=None)
@given(nd=st.sampled_from([1, 2]), B=st.integers(0, 3), C=st.integers(1, 5), n=st.integers(1, 9),
       k=st.integers(1, 4), s=st.integers(1, 3), p=st.integers(0, 3), dil=st.integers(1, 3),
       layout=st.sampled_from(["contiguous", "channels_last", "sliced"]), dtype=st.sampled_from(DTYPES))
def test_patches_equal_the_strided_view(nd, B, C, n, k, s, p, dil, layout, dtype):
    if n + 2 * p < dil * (k - 1) + 1:
        p = (dil * (k - 1) + 1 - n + 1) // 2                 # the padded input must hold one window
    spatial = [n] if nd == 1 else [n, n + 1]
    x = _input(B, C, spatial, layout, dtype)
    geo = ([k] * nd, [s] * nd, [p] * nd, [dil] * nd)
    got = kernels.conv_patches(x, *geo, use_kernel=True)
    want = kernels.conv_patches_ref(x, *geo)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)                            # a gather: bit for bit


def test_patches_of_mixed_geometry_equal_unfold():
    """Different kernel, stride, padding and dilation per dimension, against F.unfold."""
    x = torch.randn(2, 3, 11, 8, dtype=torch.float64)
    geo = dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 2), dilation=(2, 3))
    got = kernels.conv_patches(x, geo["kernel_size"], geo["stride"], geo["padding"], geo["dilation"],
                               use_kernel=True)
    want = torch.nn.functional.unfold(x, **geo).transpose(1, 2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 3), [1], [1], [0], [1]), r"expected a batched Conv1d/Conv2d input .*got shape \[2, 3\]"),
    ((torch.randn(2, 3, 5, 5), [3], [1], [0], [1]), r"need 2 entries .*got \[3\]"),
    ((torch.randn(2, 3, 5), [0], [1], [0], [1]), r"must be positive .*kernel \[0\]"),
    ((torch.randn(2, 3, 5), [3], [1], [-1], [1]), r"padding non-negative, .*padding \[-1\]"),
    ((torch.randn(2, 3, 4), [3], [1], [0], [2]), r"spans 5 positions .*padded input has 4"),
    ((torch.randint(0, 3, (2, 3, 5)), [3], [1], [0], [1]), r"expected float64, float32, bfloat16 or float16"),
])
def test_bad_geometry_is_a_clear_error(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.elasticlab.conv_patches(*args)


def test_the_cxx_conv_backward_unfolds_with_the_operator():
    """The C++ convolution's Gram and outer forms take their patches from one ``conv_patches`` call per
    chunk (profiled), and their norms still match the grouped form's."""
    from torch.profiler import ProfilerActivity, profile

    from elasticlab.gns import PerSampleGradNorms
    from elasticlab.gns.layers import conv as conv_rule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(5, 4, 3, stride=2, dilation=2)).double()
    x = torch.randn(4, 3, 12, 11, dtype=torch.float64)
    got = {}
    real = conv_rule._cxx_form
    try:
        for form in (0, 1, 2):
            conv_rule._cxx_form = lambda m, x_, dt, f=form: f
            model.zero_grad(set_to_none=True)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with PerSampleGradNorms(model, loss_reduction="sum") as n:
                    model(x).pow(2).sum().backward()
            calls = sum(e.name == "elasticlab::conv_patches" for e in prof.events())
            assert calls == (0 if form == 2 else 2), (form, calls)
            got[form] = n.param_sq_norms()
    finally:
        conv_rule._cxx_form = real
    for form in (0, 1):
        for k, v in got[2].items():
            torch.testing.assert_close(got[form][k], v, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
def test_cuda_patches_equal_the_cpu_operator(dtype, layout):
    """The CUDA kernel against the CPU one (a gather: bit for bit), 1-d and 2-d, strided and dilated,
    and a large input that exceeds neither path's 32-bit indices but takes many grid steps."""
    torch.manual_seed(1)
    cases = [([9], [3], [2], [1], [2]), ([7, 10], [3, 2], [1, 2], [2, 1], [1, 2]), ([64, 64], [3, 3], [1, 1],
             [1, 1], [1, 1]), ([33, 31], [7, 7], [2, 2], [3, 3], [1, 1])]
    for spatial, *geo in cases:
        x = _input(5, 6, spatial, layout, dtype)
        want = kernels.conv_patches(x, *geo, use_kernel=True)
        got = kernels.conv_patches(x.cuda(), *geo, use_kernel=True)
        assert got.is_cuda and got.dtype == dtype
        assert torch.equal(got.cpu(), want)
