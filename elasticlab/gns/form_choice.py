"""Which form of a layer's per-example norms runs, by cost: the outer product or the Gram matrices (Bu, Mao &
Xu 2022, "mixed ghost clipping"), and the scratch memory each takes.

On the CPU a rule of multiply-adds (:func:`use_gram`); on CUDA a cost model (:func:`cuda_prefers_gram`, rates
in :data:`CUDA_RATES` from ``benchmarks/bench_seq_linear_cuda.py``) with issue 14's memory rule: the forms'
modelled scratch (:func:`scratch_bytes`) against :data:`SCRATCH_SHARE` of the memory in use
(:func:`scratch_limit`), and ``_C``'s chunk budget of its CUDA forms (:data:`SCRATCH_CAP`,
:func:`scratch_cap`).
:mod:`elasticlab.gns.calibrate` replaces the static choice by timing the forms.
"""
from __future__ import annotations

import contextlib

import torch

from elasticlab import _ext
from elasticlab.gns import kernels, triton_outer

# Rates of the CUDA cost model behind :func:`use_gram`, from benchmarks/bench_seq_linear_cuda.py on an H100
# (2026-11-26: copy 2.9 TB/s, 8192³ GEMM 781 TFLOP/s bf16 and 52 fp32; the rates below are what the layers'
# own, smaller GEMMs reached there: G1's weight gradients ran at 400-600 bf16 and 45-50 fp32 TFLOP/s):
# sustained GEMM rate per input dtype ("tf32": float32 with TF32 matmuls allowed), memory bandwidth, and the
# fused Triton kernel's extra time in units of 2·T·Din·Dout/rate (G3: 0.6; G1's head: 0.45).
CUDA_RATES = {"bandwidth": 2.8e12, "fused_overhead": 0.6,
              "flops": {torch.bfloat16: 5e14, torch.float16: 5e14, "tf32": 3e14, torch.float32: 4.7e13,
                        torch.float64: 5e13}}


def _gemm_rate(dtype: torch.dtype, tf32: bool | None = None) -> float:
    if dtype == torch.float32 and (torch.backends.cuda.matmul.allow_tf32 if tf32 is None else tf32):
        return CUDA_RATES["flops"]["tf32"]
    return CUDA_RATES["flops"].get(dtype, CUDA_RATES["flops"][torch.float32])


def use_gram(T: int, din: int, dout: int, fused_outer: bool = False, like: torch.Tensor | None = None,
             batch: int = 1, row_major: bool = True, tf32: bool | None = None) -> bool:
    """Per-layer choice between the two forms (Bu, Mao & Xu 2022, "mixed ghost clipping").

    CPU: unfused, the outer product costs a second weight-gradient GEMM (T·Din·Dout per example) against the
    Gram form's T²·(Din+Dout): Gram when T < Din·Dout/(Din+Dout). Fused with the weight gradient the outer
    product adds only its reduction, so the Gram form is kept only for short sequences (T·(Din+Dout) <
    Din·Dout/8), where per-example GEMMs with K=T are inefficient and the Gram work is small.
    CUDA (``like`` on a GPU): a cost model. The outer form writes and reads each per-example gradient once
    (2·Din·Dout elements per example; bfloat16 ones for bfloat16 inputs, else float32), plus, unfused, a
    second weight-gradient GEMM; the Gram form costs 2·T²·(Din+Dout) GEMM FLOPs and the traffic of two T×T
    float32 Gram matrices per example. Rates in :data:`CUDA_RATES`. Half-precision row-major operands that
    :func:`elasticlab.gns.triton_outer.preferred` sends to the fused kernel write no products: the outer form
    then costs only that kernel's shortfall against the weight-gradient GEMM (``row_major=False``: operands
    such as an unfolded convolution's, which go to cuBLAS). ``tf32``: whether float32 GEMMs run on TF32 tensor
    cores (None: torch's matmul setting; a convolution passes :func:`elasticlab.gns.kernels.conv_tf32`)."""
    if like is not None and like.device.type == "cuda":
        in_registers = bool(fused_outer and row_major and kernels.USE_KERNELS and triton_outer.supported(like)
                            and triton_outer.shape_preferred(T, din, dout))
        device = like.device
        in_use = None if torch.compiler.is_compiling() else (lambda: torch.cuda.memory_allocated(device))
        return cuda_prefers_gram(T, din, dout, like.dtype, fused_outer, in_registers, batch, in_use, tf32)
    thresh = din * dout / (din + dout)
    return T < thresh / 8 if fused_outer else T < thresh


# Issue 14's memory target: a step with norms may take at most 10% more peak memory than plain. The outer
# form on cuBLAS materialises per-example products (chunks of up to SCRATCH_CAP bytes: _C's budget, set
# from here at import and by :func:`scratch_cap`),
# which on a small model is a large share of it (W2 fp32 on the H100: +46%). When that scratch exceeds
# SCRATCH_SHARE of the memory allocated on the device when the form is chosen (a lower bound of the plain
# step's peak), the Gram form, whose scratch is two T×T matrices per example, is taken instead, provided its
# modelled extra time is at most GRAM_SLOWDOWN_OK times the outer form's (otherwise time wins: e.g. G1's
# float32 layers, T=1024).
SCRATCH_SHARE = 0.10
GRAM_SLOWDOWN_OK = 2.0
# Instead (on): the outer form kept where it is faster, its products chunked to SCRATCH_SHARE of the memory in
# use (a budget of the layer's own, :func:`outer_chunk_budget`); Gram (if at most GRAM_SLOWDOWN_OK slower)
# only where one example's products alone pass the share. Off until timed on a GPU (bench_psgnorm.py's
# ``psgn-chunkshare``): on an H100 (session 10) W2 fp32 took 1.12× with the unchunked outer form (+46% peak
# memory) against 1.28× with the Gram form the rule chose; W2 is host-bound, and each further chunk costs
# two more launches (6 chunks a layer there).
CHUNK_TO_SHARE = False
SCRATCH_CAP = 256 << 20
_ext.set_scratch_bytes(SCRATCH_CAP)


@contextlib.contextmanager
def scratch_cap(n: int):
    """:data:`SCRATCH_CAP`, and ``_C``'s chunk budget with it, set to ``n`` bytes inside the block (the chunk
    sweep of ``benchmarks/bench_seq_linear_cuda.py``)."""
    global SCRATCH_CAP
    if int(n) < 1:
        raise ValueError(f"scratch_cap: expected a positive number of bytes, got {n!r}")
    prev, SCRATCH_CAP = SCRATCH_CAP, int(n)
    _ext.set_scratch_bytes(SCRATCH_CAP)
    try:
        yield
    finally:
        SCRATCH_CAP = prev
        _ext.set_scratch_bytes(prev)


def cuda_prefers_gram(T: int, din: int, dout: int, dtype: torch.dtype, fused_outer: bool, in_registers: bool,
                      batch: int, in_use=None, tf32: bool | None = None) -> bool:
    """The CUDA cost model of :func:`use_gram` (times in seconds a example, from :data:`CUDA_RATES`), with
    the scratch rule above; ``in_registers``: the Triton fused kernel serves the outer form (no products
    written); ``in_use``: a callable giving the bytes allocated on the device, called only when the rule
    applies (None: time only, e.g. while compiling, where reading the allocator would break the graph);
    ``tf32``: as :func:`use_gram`'s."""
    bw, rate = CUDA_RATES["bandwidth"], _gemm_rate(dtype, tf32)
    g_bytes = _product_bytes(dtype)
    if in_registers:
        # products stay in registers: what remains is the fused GEMM's shortfall against cuBLAS's
        outer = CUDA_RATES["fused_overhead"] * 2.0 * T * din * dout / rate
    else:
        outer = 2.0 * din * dout * g_bytes / bw
    if not fused_outer:
        outer += 2.0 * T * din * dout / rate
    gram = 2.0 * T * T * (din + dout) / rate + 16.0 * T * T / bw
    if gram < outer:
        return True
    if in_registers or in_use is None or gram > GRAM_SLOWDOWN_OK * outer:
        return False
    if CHUNK_TO_SHARE:                                 # chunked under the share, unless one example passes it
        return _chunks(batch, din, dout, dtype, SCRATCH_SHARE * in_use()) is None
    scratch_outer = scratch_bytes("outer", batch, T, din, dout, dtype)
    scratch_gram = scratch_bytes("gram", batch, T, din, dout, dtype)
    return scratch_gram < scratch_outer and scratch_outer > SCRATCH_SHARE * in_use()


def _chunks(batch: int, din: int, dout: int, dtype: torch.dtype, limit: float) -> int | None:
    """Chunks of examples the cuBLAS outer form takes with its products under ``limit`` bytes (and
    :data:`SCRATCH_CAP`); None when one example's products alone exceed it."""
    per = din * dout * _product_bytes(dtype)
    fit = int(min(limit, SCRATCH_CAP) // max(per, 1))
    return None if fit < 1 else -(-max(batch, 1) // fit)


def outer_chunk_budget(batch: int, din: int, dout: int, dtype: torch.dtype,
                       device: torch.device) -> int | None:
    """With :data:`CHUNK_TO_SHARE`, the chunk budget (bytes) of a layer whose cuBLAS outer form's products
    would pass :func:`scratch_limit` on ``device`` now: that limit, which the layer's backward then chunks
    under (``_C`` takes it at the layer's forward); None where no budget of its own is needed (the switch
    off, no rule here, the products within the limit, or one example's products over it)."""
    limit = scratch_limit(device) if CHUNK_TO_SHARE else None
    if limit is None or batch * din * dout * _product_bytes(dtype) <= limit:
        return None
    return int(min(limit, SCRATCH_CAP)) if _chunks(batch, din, dout, dtype, limit) is not None else None


def _product_bytes(dtype: torch.dtype) -> int:
    """Bytes of one per-example product element the cuBLAS outer form writes: bfloat16 ones for bfloat16
    inputs, float64 for float64, else float32."""
    return 2 if dtype == torch.bfloat16 else (8 if dtype == torch.float64 else 4)


def scratch_bytes(form: str, batch: int, T: int, din: int, dout: int, dtype: torch.dtype) -> int:
    """The memory rule's model of a form's scratch on CUDA, in bytes: ``outer`` (cuBLAS per-example products,
    bfloat16 ones for bfloat16 inputs, else float32; in chunks of at most :data:`SCRATCH_CAP`), ``gram`` (two
    T×T float32 Grams per example, likewise chunked)."""
    if form == "outer":
        return min(batch * din * dout * _product_bytes(dtype), SCRATCH_CAP)
    if form == "gram":
        return min(batch * 2 * T * T * 4, SCRATCH_CAP)
    raise ValueError(f"scratch_bytes: no model for form {form!r} (outer, gram)")


def scratch_limit(device: torch.device) -> float | None:
    """The scratch a form may take under the memory rule: :data:`SCRATCH_SHARE` of the memory allocated on
    ``device`` now (a lower bound of the plain step's peak); None off CUDA or while compiling (no rule)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    return SCRATCH_SHARE * torch.cuda.memory_allocated(device)
