"""Per-example gradient-norm kernels: ``torch.ops.elasticlab.*`` when built, the PyTorch reference otherwise.

Shapes: ``a`` (B, T, Din) layer inputs, ``d`` (B, T, Dout) gradients of the layer outputs. The per-example
weight gradient of a linear map over a sequence is G_b = Σ_t d_{b,t} a_{b,t}ᵀ (Gray et al. 2024, Sec. 3);
its squared Frobenius norm is computed without materialising all G_b at once.
Each public function takes ``use_kernel``: None (kernel when available), True (require it), False
(reference). The reference functions ``*_ref`` are the specification the compiled kernels are tested against.
Inputs may be float64, float32, bfloat16 or float16; half-precision inputs are accumulated in float32 and
their norms (and the outer form's gradient) come back in float32.
"""
from __future__ import annotations

import contextlib
import math

import torch

from elasticlab import _ext
from elasticlab.gns import triton_outer, triton_tune

# Global switch: False makes every call with use_kernel=None take the reference path (for comparisons).
USE_KERNELS = True

# Per-chunk element budget of the reference paths (bounds their scratch memory).
_CHUNK_ELEMS = 1 << 22


def _check_seq(a: torch.Tensor, d: torch.Tensor, what: str) -> None:
    if a.dim() != 3 or d.dim() != 3:
        raise ValueError(f"{what}: expected a (B,T,Din) and d (B,T,Dout), got shapes {tuple(a.shape)} "
                         f"and {tuple(d.shape)}")
    if a.shape[:2] != d.shape[:2]:
        raise ValueError(f"{what}: a and d disagree on (B,T): {tuple(a.shape[:2])} vs {tuple(d.shape[:2])}")
    if a.dtype != d.dtype or a.dtype not in FLOATING:
        raise ValueError(f"{what}: expected a and d of one floating dtype (float64, float32, bfloat16, "
                         f"float16), got {a.dtype} and {d.dtype}")


FLOATING = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation (and result) dtype of norms of ``dtype`` inputs: float32 for half precision."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd history (kernels' BLAS calls may run on threads where grad mode is on)."""
    return t.detach() if t.requires_grad else t


def _chunks(B: int, per_example: int):
    step = max(1, _CHUNK_ELEMS // max(1, per_example))
    for b0 in range(0, B, step):
        yield b0, min(B, b0 + step)


# The operators _C defines, read once (a plain constant: torch.compile traces _op without a cache wrapper).
_OPERATORS = frozenset(_ext.operators())
_OP_CACHE: dict[tuple[str, str], object] = {}      # (operator, device type) -> torch.ops handle or None
_MISSING = object()
# Filled for the CPU and CUDA up front: a compiled frame guards on this dict's contents, so a key that an
# eager call added after it would compile that frame again (once, but on every model).
if _ext.HAS_C:
    _OP_CACHE.update({(n, d): _ext.kernel(n, d) for n in sorted(_OPERATORS) if "." not in n
                      for d in ("cpu", "cuda")})


def _op(name: str, t: torch.Tensor, use_kernel: bool | None):
    if use_kernel is None and not USE_KERNELS:
        return None
    if use_kernel is False or t.dtype not in FLOATING:
        if use_kernel:
            raise ValueError(f"kernel {name!r} supports {', '.join(map(str, FLOATING))}, got {t.dtype}")
        return None
    key = (name, t.device.type)
    op = _OP_CACHE.get(key, _MISSING)
    if op is _MISSING:
        # _ext.has_kernel raises for an operator an older build of _C lacks: ask _ext.operators() first.
        op = _ext.kernel(*key) if (not _ext.HAS_C or name in _OPERATORS) else None
        if _ext.HAS_C and not torch.compiler.is_compiling():    # (a store in a traced backward breaks it)
            _OP_CACHE[key] = op
    if op is None and use_kernel:
        raise RuntimeError(f"kernel elasticlab::{name} is not built for device {t.device.type!r}")
    return op


def compiled(name: str, t: torch.Tensor) -> bool:
    """Whether the compiled kernel ``elasticlab::<name>`` serves ``t``'s dtype and device (kernels on)."""
    return _op(name, t, None) is not None


# The fused layers' C++ autograd functions (csrc/autograd/): forward and backward without
# Python on the backward path. False sends every fused layer to its Python autograd.Function (comparisons;
# torch.compile always takes those).
USE_CXX_AUTOGRAD = True
# Eager calls of those operators through _C's direct entries (csrc/bindings.cpp) rather than torch.ops' boxed
# one: the same operator and dispatch, ~6 µs less host time a layer on the 2-core CPU box. False: torch.ops.
USE_DIRECT_CALLS = True
_CXX_READY: dict[str, bool] = {}                   # device type -> the kernels the C++ backwards call exist
_CXX_OPS: dict[tuple[str, bool], object] = {}    # (name, direct) -> the callable, looked up once
_CXX_NEEDS = ("row_sq_norms", "row_sq_norms.out", "product_norms.out", "product_bias_norms",
              "batch_sum_norms", "seq_linear_gram_norms", "seq_linear_outer_norms",
              "seq_linear_outer_norms.out", "layernorm_affine_norms",
              "groupnorm_affine_norms", "conv_patches")


def cxx_autograd(name: str, x: torch.Tensor):
    """``torch.ops.elasticlab.<name>`` (through ``_C``'s direct entry, :data:`USE_DIRECT_CALLS`), a fused
    layer as a C++ autograd function, when it may serve this call
    (built, kernels and :data:`USE_CXX_AUTOGRAD` on, grad mode on, eager rather than compiling, floating ``x``
    on a device with the kernels), else None: the caller then uses its Python autograd.Function."""
    if not (USE_KERNELS and USE_CXX_AUTOGRAD) or name not in _OPERATORS or not torch.is_grad_enabled():
        return None
    if x.dtype not in FLOATING or torch.compiler.is_compiling():
        return None
    dev = "cuda" if x.is_cuda else ("cpu" if x.is_cpu else x.device.type)   # (no device object if possible)
    ok = _CXX_READY.get(dev)
    if ok is None:
        ok = _CXX_READY[dev] = all(_ext.has_kernel(k, dev) for k in _CXX_NEEDS)
    if not ok:
        return None
    key = (name, USE_DIRECT_CALLS)
    op = _CXX_OPS.get(key)
    if op is None:
        direct = _ext.direct_call(name) if USE_DIRECT_CALLS else None
        op = _CXX_OPS[key] = direct or getattr(torch.ops.elasticlab, name)
    return op


# ---------------------------------------------------------------------------------------------- reference
def seq_linear_gram_norms_ref(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Gram form: ‖G_b‖² = Σ_{t,s} (a_t·a_s)(d_t·d_s) (Li et al. 2022 ghost norm; O(B·T²·(Din+Dout)))."""
    a, d = a.to(acc_dtype(a.dtype)), d.to(acc_dtype(d.dtype))
    B, T = a.shape[:2]
    out = a.new_empty(B)
    for b0, b1 in _chunks(B, 2 * T * T):
        ga = torch.bmm(a[b0:b1], a[b0:b1].transpose(1, 2))
        gd = torch.bmm(d[b0:b1], d[b0:b1].transpose(1, 2))
        out[b0:b1] = (ga * gd).sum((1, 2))
    return out


def seq_linear_outer_norms_ref(a: torch.Tensor, d: torch.Tensor, with_grad: bool = False):
    """Outer-product form: G_b = d_bᵀ a_b formed chunk by chunk; returns (‖G_b‖² (B,), Σ_b G_b or None)."""
    a, d = a.to(acc_dtype(a.dtype)), d.to(acc_dtype(d.dtype))
    B = a.shape[0]
    Din, Dout = a.shape[2], d.shape[2]
    out = a.new_empty(B)
    grad = a.new_zeros(Dout, Din) if with_grad else None
    for b0, b1 in _chunks(B, Din * Dout):
        g = torch.bmm(d[b0:b1].transpose(1, 2), a[b0:b1])
        out[b0:b1] = g.pow(2).sum((1, 2))
        if with_grad:
            grad += g.sum(0)
    return out, grad


def layernorm_per_example_ref(x: torch.Tensor, d: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    """Per-example LayerNorm parameter gradients (Gray et al. 2024): x, d (B,T,D), mean/rstd (B,T).

    Returns (gw, gb), each (B, D): gw_b = Σ_t d_{b,t} ⊙ x̂_{b,t}, gb_b = Σ_t d_{b,t}, x̂ = (x − μ)·rstd."""
    x, d = x.to(acc_dtype(x.dtype)), d.to(acc_dtype(d.dtype))
    mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    xhat = (x - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    return (d * xhat).sum(1), d.sum(1)


def conv_patches_ref(x: torch.Tensor, kernel, stride, padding, dilation) -> torch.Tensor:
    """im2col of a zero-padded Conv1d/Conv2d input (B, C, [H,] W) as (B, L, C·k), position-major (a sequence
    Linear's layout; columns ordered (channel, kernel offsets) like ``weight.view(Cout, -1)``): one strided
    view of the padded input and one copy."""
    nd = x.dim() - 2
    if any(padding):
        x = torch.nn.functional.pad(x, [p for p in reversed(padding) for _ in range(2)])
    win = x
    for i in range(nd):                    # (B, C, L1[, L2], k1[, k2]): windows along each spatial dim
        win = win.unfold(2 + i, dilation[i] * (kernel[i] - 1) + 1, stride[i])
        if dilation[i] > 1:
            win = win[..., ::dilation[i]]
    L = win.shape[2:2 + nd]
    perm = (0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd))            # (B, L…, C, k…)
    return win.permute(perm).reshape(x.shape[0], math.prod(L), x.shape[1] * math.prod(kernel))


def row_sq_ref(x: torch.Tensor) -> torch.Tensor:
    """‖x_b‖² per row of x viewed as (B, -1), accumulated (and returned) in :func:`acc_dtype`."""
    x = x.reshape(x.shape[0], -1)
    return torch.linalg.vector_norm(x, dim=1, dtype=acc_dtype(x.dtype)).square()


# ---------------------------------------------------------------------------------------------- dispatch
def row_sq(x: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """‖x_b‖² per row of x viewed as (B, -1) (kernel ``row_sq_norms``); float32 for half inputs."""
    if x.dim() < 1:
        raise ValueError("row_sq: expected a tensor with a batch dimension, got a 0-d tensor")
    op = _op("row_sq_norms", x, use_kernel)
    if op is None:
        return row_sq_ref(x)
    # no detach where grad mode is off (inside the fused forwards and backwards): no graph is built there
    return op(x.detach() if x.requires_grad and torch.is_grad_enabled() else x)


def conv_patches(x: torch.Tensor, kernel, stride, padding, dilation, use_kernel: bool | None = None):
    """:func:`conv_patches_ref`'s patches in one pass (kernel ``conv_patches``: one launch on CUDA, where the
    strided view costs a padding fill and two copies). Geometry as lists, one entry per spatial dimension."""
    op = _op("conv_patches", x, use_kernel)
    if op is None:
        return conv_patches_ref(x, kernel, stride, padding, dilation)
    return op(_plain(x), list(kernel), list(stride), list(padding), list(dilation))


def seq_linear_gram_norms(a: torch.Tensor, d: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """Per-example ‖Σ_t d_t a_tᵀ‖² by the Gram form (kernel ``seq_linear_gram_norms``)."""
    _check_seq(a, d, "seq_linear_gram_norms")
    op = _op("seq_linear_gram_norms", a, use_kernel)
    # Kernels get detached inputs: their BLAS calls run on OpenMP threads, where grad mode is on.
    return op(_plain(a), _plain(d)) if op is not None else seq_linear_gram_norms_ref(a, d)


@torch.library.custom_op("elasticlab_triton::outer_norms", mutates_args=(),
                         schema="(Tensor a, Tensor d, bool with_grad, bool bias) -> (Tensor, Tensor, Tensor)")
def _triton_outer_op(a, d, with_grad, bias):
    """:func:`elasticlab.gns.triton_tune.outer_norms` as an operator, which a traced backward
    (``torch.compile``) records as one opaque call, run with real tensors (tuned and launched as in eager):
    (norms (B,), the weight gradient (Dout, Din) or (0,), the bias sums (B, Dout) or (0,)), in float32 for
    half-precision inputs (:func:`acc_dtype`; the fused Gram form's gradient, in the inputs' dtype, cast)."""
    out = triton_tune.outer_norms(a, d, with_grad, bias)
    f = acc_dtype(a.dtype)
    none = a.new_empty(0, dtype=f)
    return (out[0].to(f), out[1].to(f) if with_grad else none, out[2].to(f) if bias else none.clone())


@_triton_outer_op.register_fake
def _(a, d, with_grad, bias):
    f = acc_dtype(a.dtype)
    B, Din, Dout = a.shape[0], a.shape[2], d.shape[2]
    return (a.new_empty(B, dtype=f), a.new_empty((Dout, Din) if with_grad else (0,), dtype=f),
            a.new_empty((B, Dout) if bias else (0,), dtype=f))


def seq_linear_outer_norms(a: torch.Tensor, d: torch.Tensor, with_grad: bool = False,
                           use_kernel: bool | None = None, bias: bool = False):
    """Per-example ‖Σ_t d_t a_tᵀ‖² by the outer-product form, fused with the weight gradient Σ_b G_b when
    ``with_grad``. Returns (sq_norms (B,), grad (Dout, Din) or None), and with ``bias`` a third entry: each
    example's bias gradient Σ_t d_t (B, Dout), in float32 for half-precision inputs. Half-precision inputs on
    CUDA take the Triton kernel of :mod:`elasticlab.gns.triton_outer` (products never leave registers; the
    bias sums come from the δ tiles it loads); others, and ``use_kernel=True``, the compiled
    ``seq_linear_outer_norms`` (cuBLAS batched GEMMs on CUDA) and ``d.sum(1)``."""
    _check_seq(a, d, "seq_linear_outer_norms")
    if use_kernel is None and USE_KERNELS and triton_outer.preferred(a, d):
        if torch.compiler.is_compiling():                 # traced: the Triton forms as one opaque operator
            norms, grad, db = torch.ops.elasticlab_triton.outer_norms(_plain(a), _plain(d), with_grad, bias)
            return (norms, grad if with_grad else None, *((db,) if bias else ()))
        return triton_tune.outer_norms(_plain(a), _plain(d), with_grad, bias)     # fused on tensor cores
    op = _op("seq_linear_outer_norms", a, use_kernel)
    if op is None:
        out = seq_linear_outer_norms_ref(a, d, with_grad)
    else:
        norms, grad = op(_plain(a), _plain(d), with_grad)
        out = norms, (grad if with_grad else None)
    return (*out, d.sum(1, dtype=acc_dtype(d.dtype))) if bias else out


def layernorm_per_example(x: torch.Tensor, d: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                          use_kernel: bool | None = None):
    """Per-example LayerNorm (weight, bias) gradients, each (B, D) (kernel ``layernorm_per_example``)."""
    if x.dim() != 3 or d.shape != x.shape or mean.shape != x.shape[:2] or rstd.shape != x.shape[:2]:
        raise ValueError(f"layernorm_per_example: expected x, d (B,T,D) and mean, rstd (B,T); got "
                         f"{tuple(x.shape)}, {tuple(d.shape)}, {tuple(mean.shape)}, {tuple(rstd.shape)}")
    op = _op("layernorm_per_example", x, use_kernel)
    if x.dtype != d.dtype:
        raise ValueError(f"layernorm_per_example: x and d must share a dtype, got {x.dtype} and {d.dtype}")
    acc = acc_dtype(x.dtype)
    if mean.dtype != acc or rstd.dtype != acc:                  # (no dispatch when they already are)
        mean, rstd = mean.to(acc), rstd.to(acc)
    if op is None:
        return layernorm_per_example_ref(x, d, mean, rstd)
    return tuple(op(_plain(x), _plain(d), _plain(mean), _plain(rstd)))


_FP32_PRECISION = getattr(torch._C, "_get_fp32_precision_getter", None)     # (torch >= 2.9; 0.25 µs a call)


def conv_tf32() -> bool:
    """Whether float32 convolutions on CUDA run on TF32 tensor cores: cuDNN's convolution setting
    (``torch.backends.cudnn.conv.fp32_precision``, "tf32" by default; ``torch.backends.cudnn.allow_tf32`` in
    torch before 2.9). A convolution's per-example GEMMs follow it, as its weight gradient (cuDNN's) does."""
    if _FP32_PRECISION is not None:
        return _FP32_PRECISION("cuda", "conv") == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


def conv_takes_tf32(x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether a convolution computed in float32 (``dtype``, else ``x``'s) takes TF32 for its per-example
    GEMMs: on CUDA, as :func:`conv_tf32` says (its weight gradient, cuDNN's, runs so)."""
    return x.is_cuda and (dtype or x.dtype) == torch.float32 and conv_tf32()


@contextlib.contextmanager
def tf32_mode(on: bool):
    """Float32 per-example GEMMs of the compiled kernels (cuBLAS) on this thread with TF32 (``on``) or exact,
    whatever torch's matmul setting: what the C++ convolution backward sets for itself, for the Python
    autograd path of a convolution. No effect while compiling (a traced call would not run it)."""
    prev = None if torch.compiler.is_compiling() else _ext.set_tf32_mode(int(bool(on)))
    try:
        yield
    finally:
        if prev is not None:
            _ext.set_tf32_mode(prev)
