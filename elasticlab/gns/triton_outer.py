"""Per-example outer-product norms fused into the weight-gradient GEMM on tensor cores (Triton).

Each program owns a (BM × BN) tile of the weight gradient. For every example b it forms its tile of
G_b = Σ_t δ_{b,t} a_{b,t}ᵀ in registers (``tl.dot``: wgmma on Hopper, mma elsewhere), adds ‖tile‖² to a
partial norm of b and the tile into its gradient accumulator: the products never reach memory, and the only
work beyond the weight-gradient GEMM is a square-and-sum per tile and example (the floor of
``shared/reference/psgnorm-anchors.md``). Partial norms are summed afterwards (deterministic); when the tiles
alone are too few to fill the GPU the examples are split over a second grid axis, each split writing its own
gradient slice, summed afterwards.

Used for bfloat16/float16 inputs on CUDA when Triton is importable (it ships with CUDA builds of torch), and
for float32 ones when :data:`FP32` is on; the cuBLAS path of ``torch.ops.elasticlab.seq_linear_outer_norms``
is the fallback and the reference. Without a GPU the kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1``, CPU tensors): ``tests/gns/test_triton_outer.py``, run so in CI.
"""
from __future__ import annotations

import os

import torch

try:  # pragma: no cover - depends on the torch build
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False
try:  # pragma: no cover - Triton 3.4 and later
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TMA = HAS_TRITON
except ImportError:  # pragma: no cover
    HAS_TMA = False

# Triton's CPU interpreter (set before Triton is imported): the kernels run on CPU tensors, without bfloat16.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device() -> str | None:
    """Where this package's Triton kernels can run now: "cpu" under the interpreter (:data:`INTERPRETED`),
    "cuda" with Triton and a GPU, else None (what their tests skip on)."""
    if not HAS_TRITON:
        return None
    return "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)


def kernel_dtypes() -> list[torch.dtype]:
    """The input dtypes the kernels take on :func:`kernel_device`: float16 and float32, and bfloat16 on a GPU
    (the interpreter computes in numpy, which has no bfloat16)."""
    return [torch.float16, torch.float32] + ([] if INTERPRETED else [torch.bfloat16])


# Switch for comparisons (benchmarks): False sends every call to the cuBLAS operator.
ENABLED = True
# float32 inputs too: exact float32 products ("ieee"), or TF32 where torch.backends.cuda.matmul.allow_tf32
# allows them, as the layer's own GEMM would. Off until measured on a GPU against cuBLAS (no product
# scratch, against the batched GEMM's B·Din·Dout floats: W2's +46% peak memory).
FP32 = False
# The loop that runs untuned (on a GPU :mod:`elasticlab.gns.triton_tune` times the loops per shape): True,
# one loop over (example, K step) pairs, pipelined across examples (the flattened loop of Triton's
# persistent-matmul tutorial); False, a K loop per example inside a loop over examples.
FLAT = False
# Hopper's tensor-memory accelerator untuned (where :func:`tma_ok`: 16-byte aligned rows, compute capability
# 9 or later): :func:`_outer_norms_tma_kernel` loads each example's (BK × tile) blocks through TMA
# descriptors (zero fill past T, no masks in the loop) and writes a partial norm per gradient row.
TMA = False

if HAS_TRITON:
    @triton.jit
    def _seq_k_step(a_ptr, d_ptr, b64, tk, T, offs_m, offs_n, m_ok, n_ok, sa_b, sa_t, sa_i, sd_b, sd_t, sd_o,
                    acc, PRECISION: tl.constexpr):
        """One K step of example b's tile: acc + δ_bᵀ[offs_m, tk] a_b[tk, offs_n] (rows past T: zeros)."""
        k_ok = tk < T
        dt = tl.load(d_ptr + b64 * sd_b + tk[None, :] * sd_t + offs_m[:, None] * sd_o,
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)                   # δ_bᵀ tile (BM, BK)
        at = tl.load(a_ptr + b64 * sa_b + tk[:, None] * sa_t + offs_n[None, :] * sa_i,
                     mask=k_ok[:, None] & n_ok[None, :], other=0.0)                   # a_b tile (BK, BN)
        return tl.dot(dt, at, acc, input_precision=PRECISION)

    @triton.jit
    def _example_done(acc, gacc, partial_ptr, b, num_tiles, pid, WITH_GRAD: tl.constexpr):
        """Example b's tile is complete: its ‖tile‖² to partial[b, pid], the tile into the gradient
        accumulator (returned)."""
        tl.store(partial_ptr + b * num_tiles + pid, tl.sum(tl.sum(acc * acc, axis=1), axis=0))
        if WITH_GRAD:
            gacc += acc
        return gacc

    @triton.jit
    def _store_grad(grad_ptr, gacc, split, offs_m, offs_n, m_ok, n_ok, Dout, Din, GRAD_T: tl.constexpr):
        """The tile's gradient accumulator to split ``split``'s (Dout, Din) slice of the gradient, or with
        ``GRAD_T`` transposed into a (Din, Dout) slice (a mirrored launch writing the layer's own layout)."""
        if GRAD_T:
            g_ptrs = grad_ptr + split * Dout * Din + offs_n[None, :] * Dout + offs_m[:, None]
        else:
            g_ptrs = grad_ptr + split * Dout * Din + offs_m[:, None] * Din + offs_n[None, :]
        tl.store(g_ptrs, gacc, mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _outer_norms_kernel(a_ptr, d_ptr, partial_ptr, grad_ptr, B, T, Din, Dout,
                            sa_b, sa_t, sa_i, sd_b, sd_t, sd_o, SPLIT,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WITH_GRAD: tl.constexpr,
                            PRECISION: tl.constexpr, FLAT: tl.constexpr, GRAD_T: tl.constexpr):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_n = tl.cdiv(Din, BN)
        num_tiles = tl.num_programs(0)
        pm, pn = pid // num_n, pid % num_n
        offs_m = pm * BM + tl.arange(0, BM)                  # rows of the gradient (Dout)
        offs_n = pn * BN + tl.arange(0, BN)                  # columns (Din)
        offs_k = tl.arange(0, BK)
        m_ok, n_ok = offs_m < Dout, offs_n < Din
        gacc = tl.zeros((BM, BN), dtype=tl.float32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if FLAT:
            # One loop over (example, K step) pairs, as the weight-gradient GEMM's single K loop over B·T
            # rows: the software pipeline keeps loading across examples instead of draining at the end of
            # each one's T/BK steps; the per-example epilogue runs on the last step of each example.
            k_tiles = tl.cdiv(T, BK)
            n_b = tl.cdiv(B - split, SPLIT)
            for it in range(0, n_b * k_tiles):
                eb = it // k_tiles
                ki = it - eb * k_tiles
                b = split + eb * SPLIT
                b64 = tl.cast(b, tl.int64)            # b·stride passes 2³¹ on inputs of over 2³¹ elements
                acc = _seq_k_step(a_ptr, d_ptr, b64, ki * BK + offs_k, T, offs_m, offs_n, m_ok, n_ok,
                                  sa_b, sa_t, sa_i, sd_b, sd_t, sd_o, acc, PRECISION)
                if ki == k_tiles - 1:
                    gacc = _example_done(acc, gacc, partial_ptr, b, num_tiles, pid, WITH_GRAD)
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
        else:
            # A loop over the examples around a K loop over each one's T rows.
            for b in range(split, B, SPLIT):
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                b64 = tl.cast(b, tl.int64)
                for t0 in range(0, T, BK):
                    acc = _seq_k_step(a_ptr, d_ptr, b64, t0 + offs_k, T, offs_m, offs_n, m_ok, n_ok,
                                      sa_b, sa_t, sa_i, sd_b, sd_t, sd_o, acc, PRECISION)
                gacc = _example_done(acc, gacc, partial_ptr, b, num_tiles, pid, WITH_GRAD)
        if WITH_GRAD:                                        # norms only: no gradient buffer at all
            _store_grad(grad_ptr, gacc, split, offs_m, offs_n, m_ok, n_ok, Dout, Din, GRAD_T)

    @triton.jit
    def _tma_k_step(a_desc, d_desc, b, t0, m0, n0, acc,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
        """One K step of example b's tile from the TMA descriptors (rows past T arrive as zeros)."""
        dt = d_desc.load([b, t0, m0]).reshape(BK, BM)
        at = a_desc.load([b, t0, n0]).reshape(BK, BN)
        return tl.dot(dt.T, at, acc, input_precision=PRECISION)

    @triton.jit
    def _example_rows_done(acc, gacc, partial_ptr, b, num_tiles, pid, rows, BM: tl.constexpr,
                           WITH_GRAD: tl.constexpr):
        """:func:`_example_done` with a partial norm per gradient row (a reduction within each warp):
        partial[b, pid, :] (rows past Dout: zeros)."""
        base = (tl.cast(b, tl.int64) * num_tiles + pid) * BM
        tl.store(partial_ptr + base + rows, tl.sum(acc * acc, axis=1))
        if WITH_GRAD:
            gacc += acc
        return gacc

    @triton.jit
    def _outer_norms_tma_kernel(a_desc, d_desc, partial_ptr, grad_ptr, B, T, Din, Dout, SPLIT,
                                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WITH_GRAD: tl.constexpr,
                                PRECISION: tl.constexpr, FLAT: tl.constexpr, GRAD_T: tl.constexpr,
                                OVERLAP: tl.constexpr):
        """:func:`_outer_norms_kernel` with operands from TMA descriptors over a (B, T, Din) and d (B, T,
        Dout) (blocks [1, BK, BN] and [1, BK, BM]) and a partial norm per gradient row: partial is (B, tiles,
        BM). ``OVERLAP`` (flat loop): a second accumulator holds each finished example's tile, whose norm
        (squares, row sums, their store) is taken in the next example's first K step, after that step's MMA
        is issued, so that it runs on the CUDA cores while the tensor cores work, instead of between them."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_n = tl.cdiv(Din, BN)
        num_tiles = tl.num_programs(0)
        m0 = (pid // num_n) * BM
        n0 = (pid % num_n) * BN
        rows = tl.arange(0, BM)
        gacc = tl.zeros((BM, BN), dtype=tl.float32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if FLAT and OVERLAP:
            k_tiles = tl.cdiv(T, BK)
            n_b = tl.cdiv(B - split, SPLIT)
            done = tl.zeros((BM, BN), dtype=tl.float32)          # the last finished example's tile
            for it in range(0, n_b * k_tiles):
                eb = it // k_tiles
                ki = it - eb * k_tiles
                b = split + eb * SPLIT
                acc = _tma_k_step(a_desc, d_desc, b, ki * BK, m0, n0, acc, BM, BN, BK, PRECISION)
                if (ki == 0) & (eb > 0):                          # the previous example's norm
                    _example_rows_done(done, gacc, partial_ptr, b - SPLIT, num_tiles, pid, rows, BM, False)
                if ki == k_tiles - 1:
                    if WITH_GRAD:
                        gacc += acc
                    # computed here, after the tile's wait: a bare copy would become a select on the tile
                    # in flight, which waits for it at every step
                    done = acc + 0.0
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
            last = split + (n_b - 1) * SPLIT
            _example_rows_done(done, gacc, partial_ptr, last, num_tiles, pid, rows, BM, False)
        elif FLAT:
            k_tiles = tl.cdiv(T, BK)
            n_b = tl.cdiv(B - split, SPLIT)
            for it in range(0, n_b * k_tiles):
                eb = it // k_tiles
                ki = it - eb * k_tiles
                b = split + eb * SPLIT
                acc = _tma_k_step(a_desc, d_desc, b, ki * BK, m0, n0, acc, BM, BN, BK, PRECISION)
                if ki == k_tiles - 1:
                    gacc = _example_rows_done(acc, gacc, partial_ptr, b, num_tiles, pid, rows, BM, WITH_GRAD)
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
        else:
            for b in range(split, B, SPLIT):
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                for t0 in range(0, T, BK):
                    acc = _tma_k_step(a_desc, d_desc, b, t0, m0, n0, acc, BM, BN, BK, PRECISION)
                gacc = _example_rows_done(acc, gacc, partial_ptr, b, num_tiles, pid, rows, BM, WITH_GRAD)
        if WITH_GRAD:
            offs_m, offs_n = m0 + rows, n0 + tl.arange(0, BN)
            _store_grad(grad_ptr, gacc, tl.cast(split, tl.int64), offs_m, offs_n, offs_m < Dout, offs_n < Din,
                        Dout, Din, GRAD_T)


# Where the fused kernel beat cuBLAS batched GEMMs + fold (benchmarks/bench_seq_linear_cuda.py, H100, bf16,
# 2026-11-26): layers with at least this many 128×128 gradient tiles (G1's 768→50304 head: 1.71× the weight
# GEMM against 2.26×; G3's 1024↔4096 at B=64: 1.94× against 2.2×) or short sequences (T=128: 2.86× against
# 4.02×). On G1's block layers (36–144 tiles, T=1024) cuBLAS won (2.07–2.23× against 2.27–2.77×).
MIN_TILES, MAX_SHORT_T = 200, 128
_PROPS: dict[int, object] = {}                     # CUDA device index -> torch.cuda.get_device_properties


def supported(a: torch.Tensor) -> bool:
    """Whether the fused path takes these inputs: on CUDA with Triton present, half precision (and float32
    when :data:`FP32` is on)."""
    if not (HAS_TRITON and ENABLED and a.is_cuda):
        return False
    return a.dtype in (torch.bfloat16, torch.float16) or (FP32 and a.dtype == torch.float32)


def preferred(a: torch.Tensor, d: torch.Tensor) -> bool:
    """Whether to send this layer to the fused kernel rather than to cuBLAS: supported inputs, row-major
    operands (an unfolded convolution's transposed views load uncoalesced), and a shape where it measured
    faster (:data:`MIN_TILES`, :data:`MAX_SHORT_T`)."""
    if a.stride(-1) != 1 or d.stride(-1) != 1:
        return False
    return takes(a, a.shape[1], a.shape[2], d.shape[2])


def takes(like: torch.Tensor, T: int, din: int, dout: int) -> bool:
    """Whether the fused kernel serves a (row-major) layer of this shape whose inputs have ``like``'s dtype
    and device (the choice :func:`preferred` makes, from the shape alone)."""
    return supported(like) and shape_preferred(T, din, dout)


def shape_preferred(T: int, din: int, dout: int) -> bool:
    """The measured shape rule alone: at least :data:`MIN_TILES` 128×128 gradient tiles, or T ≤
    :data:`MAX_SHORT_T`."""
    return -(-din // 128) * -(-dout // 128) >= MIN_TILES or T <= MAX_SHORT_T


def _sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of ``dev``; 4 for a CPU tensor (Triton's interpreter, ``TRITON_INTERPRET=1``,
    where tests run the kernel without a GPU and this count only sets how the examples are split)."""
    return _props(dev).multi_processor_count if dev.type == "cuda" else 4


def _props(dev: torch.device):
    """``dev``'s CUDA device properties, read once per device."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    p = _PROPS.get(idx)
    if p is None:
        p = _PROPS[idx] = torch.cuda.get_device_properties(idx)
    return p


def _split(B: int, tiles: int, dev: torch.device) -> int:
    """How many groups the B examples are split into over the grid's second axis: enough programs for two
    per SM."""
    return max(1, min(B, (2 * _sm_count(dev)) // tiles))


def _config(Din: int, Dout: int, dtype: torch.dtype | None = None) -> tuple[int, int, int, int, int, bool]:
    """(BM, BN, BK, num_warps, num_stages, flat): 128×128 tiles for wide layers, narrower for thin ones; the
    loop of :data:`FLAT`. 16-bit 128×128×64 tiles take 4 pipeline stages (they beat 3 in every H100 sweep of
    ``bench_seq_linear_cuda.py``, sessions 3, 5 and 10); float32 ones 3 (four would pass 227 KB of shared
    memory)."""
    bm = 128 if Dout >= 128 else 64
    bn = 128 if Din >= 128 else 64
    wide = bm * bn >= 128 * 128
    stages = 4 if wide and dtype in (torch.bfloat16, torch.float16) else 3
    return bm, bn, 64, 8 if wide else 4, stages, FLAT


# The TMA kernel's third loop: the flat loop with each example's norm deferred into the next one's first K
# step, a second accumulator holding its tile (three float32 tiles a thread: 128×128 spills 110-130 B on
# sm_90, bounded by .ci/triton_aot.py). Not yet timed on a GPU; the tuner keeps it only where it is fastest.
OVERLAP = 2
LOOPS = {False: "nested", True: "flat", OVERLAP: "overlap"}          # a config's ``loop``: its name


def scratch_bytes(B: int, Din: int, Dout: int, device: torch.device, config: tuple | None = None,
                  tma: bool = False, dtype: torch.dtype | None = None) -> int:
    """Bytes :func:`outer_norms` allocates beyond its results: the partial norms (B × tiles floats, × BM for
    the TMA form's per-row partials) and, when the examples are split, the splits' gradient slices beyond
    the first."""
    bm, bn = (config or _config(Din, Dout, dtype))[:2]
    tiles = -(-Dout // bm) * -(-Din // bn)
    split = _split(B, tiles, device)
    return 4 * (B * tiles * (bm if tma else 1) + (split - 1) * Dout * Din)


def _precision(dtype: torch.dtype, tf32: bool | None = None) -> str:
    """``tl.dot``'s input precision: for float32, exact unless TF32 is allowed (``tf32``; None: torch's matmul
    setting, as a Linear's own GEMM runs); half-precision operands multiply exactly on tensor cores either
    way."""
    if dtype == torch.float32 and not (torch.backends.cuda.matmul.allow_tf32 if tf32 is None else tf32):
        return "ieee"
    return "tf32"


def outer_norms(a: torch.Tensor, d: torch.Tensor, with_grad: bool, config: tuple | None = None):
    """(‖G_b‖² (B,) float32, Σ_b G_b (Dout, Din) float32 or None) for a (B,T,Din), d (B,T,Dout).
    ``config``: (BM, BN, BK, num_warps, num_stages[, loop[, tma[, swap]]]) instead of :func:`_config`'s;
    ``loop``: False nested, True flat, :data:`OVERLAP` (TMA only), else :data:`FLAT`'s; ``tma``: else
    :data:`TMA`'s, where :func:`tma_ok`; ``swap``: the kernel on the mirrored shape, G_bᵀ (rows over Din,
    same norms), each gradient tile stored transposed so that the gradient is (Dout, Din) still.
    ``with_grad=False``: no gradient buffer, no gradient tile stored (the partial norms are all it writes)."""
    B, T, Din = a.shape
    Dout = d.shape[2]
    if B == 0 or T == 0 or Din == 0 or Dout == 0:
        z = torch.zeros(B, device=a.device)
        return z, (torch.zeros(Dout, Din, device=a.device) if with_grad else None)
    bm, bn, bk, warps, stages, *rest = config or _config(Din, Dout, a.dtype)
    loop = int(rest[0]) if rest else int(FLAT)
    if loop not in LOOPS:
        raise ValueError("outer_norms: loop must be " + ", ".join(f"{k} ({v})" for k, v in LOOPS.items())
                         + f", got {rest[0]!r}")
    tma = bool(rest[1]) if len(rest) > 1 else TMA
    if len(rest) > 2 and rest[2]:                  # the mirror: rows over Din, the gradient stored transposed
        a, d, Din, Dout = d, a, Dout, Din
    meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=bool(with_grad), PRECISION=_precision(a.dtype),
                FLAT=loop != 0, GRAD_T=len(rest) > 2 and bool(rest[2]), num_warps=warps, num_stages=stages)
    tiles = triton.cdiv(Dout, bm) * triton.cdiv(Din, bn)
    shape = (Din, Dout) if meta["GRAD_T"] else (Dout, Din)            # the layer's (out, in) either way
    if tma and tma_ok(a, d):
        operands = (TensorDescriptor(a, list(a.shape), list(a.stride()), [1, bk, bn]),
                    TensorDescriptor(d, list(d.shape), list(d.stride()), [1, bk, bm]))
        return run_tiles(_outer_norms_tma_kernel, a, d, (B, T, Din, Dout), tiles, *shape, with_grad,
                         dict(meta, OVERLAP=loop == OVERLAP), operands=operands, rows_per_tile=bm)
    if loop == OVERLAP:
        raise ValueError("outer_norms: the overlapped loop needs TMA loads (tma=True where tma_ok)")
    return run_tiles(_outer_norms_kernel, a, d, (B, T, Din, Dout, *a.stride(), *d.stride()), tiles, *shape,
                     with_grad, meta)


def tma_ok(a: torch.Tensor, d: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these operands: Triton's descriptors present, a GPU with the tensor
    memory accelerator (compute capability 9 or later; CPU tensors: Triton's interpreter), one floating
    dtype of 2 or 4 bytes, unit last strides, and 16-byte aligned bases and outer strides (else the pointer
    kernel)."""
    if not HAS_TMA or a.dtype != d.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if a.is_cuda and _props(a.device).major < 9:
        return False
    for t in (a, d):
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


def launch(kernel, grid: tuple, device: torch.device, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)`` on ``device``'s CUDA context when that is not the current one (a CPU
    device under the interpreter: as is)."""
    if device.index is None or device.index == torch.cuda.current_device():
        kernel[grid](*args, **meta)
    else:
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)


def run_tiles(kernel, a: torch.Tensor, d: torch.Tensor, scalars: tuple, tiles: int, rows: int, cols: int,
              with_grad: bool, meta: dict, operands: tuple | None = None, rows_per_tile: int = 1):
    """Launches a fused per-example-norm kernel ``kernel(a, d, partial, grad, *scalars, SPLIT, **meta)`` on a
    (tiles, split) grid, the B examples of ``a`` split over enough programs for two per SM, and returns
    (‖G_b‖² (B,) float32, the (rows, cols) float32 gradient or None): the partial norms (B, tiles ×
    ``rows_per_tile``) summed over tiles, the splits' gradient slices over splits (both deterministic).
    ``operands``: what the kernel takes in place of (a, d), e.g. TMA descriptors over them."""
    B = a.shape[0]
    split = _split(B, tiles, a.device)
    partial = torch.empty(B, tiles * rows_per_tile, device=a.device, dtype=torch.float32)
    # norms only: the kernel never touches grad_ptr (WITH_GRAD is a compile-time constant), so it gets the
    # partial buffer as a placeholder
    grad = torch.empty(split, rows, cols, device=a.device, dtype=torch.float32) if with_grad else partial
    launch(kernel, (tiles, split), a.device, (*(operands or (a, d)), partial, grad, *scalars, split), meta)
    norms = partial.sum(1)
    if not with_grad:
        return norms, None
    return norms, (grad[0] if split == 1 else grad.sum(0))
