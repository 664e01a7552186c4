"""Per-example convolution weight-gradient norms by implicit GEMM (Triton): no unfolded input, no products.

A Conv2d's (groups = 1) per-example weight gradient is the outer-product form of a Linear over its output
positions: G_b = Σ_p δ_{b,p} u_{b,p}ᵀ, with u_{b,p} the input patch under position p (Din = Cin·kh·kw, the
columns of ``weight.view(Cout, -1)``, ordered (channel, row, column) of the kernel). The batched-GEMM path
of :mod:`elasticlab.gns.layers.conv` writes every patch (im2col) and every product G_b to memory; here each
program owns a (BM × BN) tile of the weight gradient and loads its patch columns straight from the input,
with the convolution's stride, padding and dilation in the addressing (zero padding by the load mask): an
implicit GEMM. As in :mod:`elasticlab.gns.triton_outer`'s flat loop, one loop runs over (example, K step)
pairs; at the last K step of each example the tile's ‖·‖² goes to that example's partial norm and the tile
into the gradient accumulator. Conv1d is the case H = 1.

Used on CUDA when :data:`elasticlab.gns.layers.conv.TRITON_ON_CUDA` is on (off until measured against the
batched GEMM); tested on the CPU under Triton's interpreter (``tests/gns/test_triton_conv.py``).
"""
from __future__ import annotations

import torch

from elasticlab._ext import conv_out_sizes
from elasticlab.gns import kernels, triton_launch, triton_outer
from elasticlab.gns.triton_launch import HAS_TRITON

if HAS_TRITON:  # pragma: no cover - depends on the torch build
    import triton
    import triton.language as tl

    from elasticlab.gns.triton_outer import _example_done, _store_grad, _tile_origin  # (shared)

    @triton.jit
    def _conv_outer_norms_kernel(x_ptr, d_ptr, partial_ptr, grad_ptr, B, Cin, H, W, Cout, Ho, Wo,
                                 sx_b, sx_c, sx_h, sx_w, sd_b, sd_c, sd_h, sd_w,
                                 stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, SPLIT,
                                 KH: tl.constexpr, KW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                 BK: tl.constexpr, WITH_GRAD: tl.constexpr, PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        Din = Cin * KH * KW
        T = Ho * Wo
        num_n = tl.cdiv(Din, BN)
        num_tiles = tl.num_programs(0)
        # rows of the gradient: output channels; columns: (input channel, kernel row, kernel column)
        _, _, offs_m, offs_n = _tile_origin(pid, num_n, BM, BN, False)
        offs_k = tl.arange(0, BK)
        m_ok, n_ok = offs_m < Cout, offs_n < Din
        ci = offs_n // (KH * KW)
        r = offs_n % (KH * KW)
        dh = (r // KW) * dil_h - pad_h                       # input row of the patch element, less oh·stride
        dw = (r % KW) * dil_w - pad_w
        col = ci * sx_c
        gacc = tl.zeros((BM, BN), dtype=tl.float32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_tiles = tl.cdiv(T, BK)
        n_b = tl.cdiv(B - split, SPLIT)
        for it in range(0, n_b * k_tiles):
            eb = it // k_tiles
            ki = it - eb * k_tiles
            b = split + eb * SPLIT
            b64 = tl.cast(b, tl.int64)                # b·stride passes 2³¹ on inputs of over 2³¹ elements
            p = ki * BK + offs_k                             # output positions of this K step
            p_ok = p < T
            oh = p // Wo
            ow = p % Wo
            dt = tl.load(d_ptr + b64 * sd_b + offs_m[:, None] * sd_c + oh[None, :] * sd_h
                         + ow[None, :] * sd_w, mask=m_ok[:, None] & p_ok[None, :], other=0.0)  # δ_bᵀ (BM, BK)
            ih = oh[:, None] * stride_h + dh[None, :]
            iw = ow[:, None] * stride_w + dw[None, :]
            ok = p_ok[:, None] & n_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            at = tl.load(x_ptr + b64 * sx_b + col[None, :] + ih * sx_h + iw * sx_w, mask=ok, other=0.0)
            acc = tl.dot(dt, at, acc, input_precision=PRECISION)                   # patches (BK, BN)
            if ki == k_tiles - 1:
                gacc = _example_done(acc, gacc, partial_ptr, b, num_tiles, pid, WITH_GRAD)
                acc = tl.zeros((BM, BN), dtype=tl.float32)
        if WITH_GRAD:
            _store_grad(grad_ptr, gacc, split, offs_m, offs_n, m_ok, n_ok, Cout, Din, False)


def supported(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether the kernel serves this convolution: Conv1d/Conv2d with one group and zero padding given as
    numbers, on inputs :func:`elasticlab.gns.triton_outer.supported` takes (CUDA; half precision, or float32
    with ``triton_outer.FP32``)."""
    if not isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)) or module.groups != 1:
        return False
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return False
    return triton_outer.supported(x)


def _config(T: int, Din: int, Dout: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages): 64-wide tiles for narrow layers, K steps no longer than T."""
    bm = 128 if Dout >= 128 else 64
    bn = 128 if Din >= 128 else 64
    bk = 16 if T <= 16 else 32 if T <= 32 else 64
    return bm, bn, bk, 8 if bm * bn >= 128 * 128 else 4, 3


def _geometry(module: torch.nn.Module):
    """(kernel, stride, padding, dilation) as 2-D pairs (Conv1d: a first dimension of 1)."""
    if isinstance(module, torch.nn.Conv1d):
        return ((1, *module.kernel_size), (1, *module.stride), (0, *module.padding), (1, *module.dilation))
    return module.kernel_size, module.stride, module.padding, module.dilation


def conv_outer_norms(module: torch.nn.Module, x: torch.Tensor, d: torch.Tensor, with_grad: bool,
                     config: tuple | None = None):
    """(‖G_b‖² (B,) float32, Σ_b G_b shaped like ``module.weight``, float32, or None) of a convolution
    (:func:`supported`) with input ``x`` (B, Cin, [H,] W) and output gradient ``d`` (B, Cout, [Ho,] Wo).
    ``config``: (BM, BN, BK, num_warps, num_stages) instead of :func:`_config`'s."""
    nd = 1 if isinstance(module, torch.nn.Conv1d) else 2
    if x.dim() != nd + 2 or x.shape[1] != module.in_channels:
        raise ValueError(f"conv_outer_norms: {type(module).__name__}(in_channels={module.in_channels}) got "
                         f"an input of shape {tuple(x.shape)}")
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _geometry(module)
    out = conv_out_sizes(x.shape[2:], (kh, kw)[-nd:], (sh, sw)[-nd:], (ph, pw)[-nd:], (dh, dw)[-nd:])
    want = (x.shape[0], module.out_channels, *out)
    if tuple(d.shape) != want:
        raise ValueError(f"conv_outer_norms: output gradient of shape {tuple(d.shape)}, expected {want} for "
                         f"an input of shape {tuple(x.shape)}")
    if nd == 1:                                               # Conv1d: one row
        x, d = x.unsqueeze(2), d.unsqueeze(2)
    B, Cin, H, W = x.shape
    Cout, Ho, Wo = d.shape[1:]
    Din, T = Cin * kh * kw, Ho * Wo
    wshape = module.weight.shape
    if B == 0 or T == 0 or Din == 0 or Cout == 0:
        z = torch.zeros(B, device=x.device)
        return z, (torch.zeros(wshape, device=x.device) if with_grad else None)
    bm, bn, bk, warps, stages = config or _config(T, Din, Cout)
    tiles = triton.cdiv(Cout, bm) * triton.cdiv(Din, bn)
    meta = dict(KH=kh, KW=kw, BM=bm, BN=bn, BK=bk, WITH_GRAD=bool(with_grad),
                PRECISION=triton_launch.precision(x.dtype, tf32=kernels.conv_takes_tf32(x)),
                num_warps=warps, num_stages=stages)
    scalars = (B, Cin, H, W, Cout, Ho, Wo, *x.stride(), *d.stride(), sh, sw, ph, pw, dh, dw)
    norms, grad = triton_launch.run_tiles(_conv_outer_norms_kernel, x, d, scalars, tiles, Cout, Din,
                                          with_grad, meta)
    return norms, (grad.view(wshape) if with_grad else None)
