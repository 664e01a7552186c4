"""Per-example outer-product norms fused into the weight-gradient GEMM on tensor cores (Triton).

Each program owns a (BM × BN) tile of the weight gradient. For every example b it forms its tile of
G_b = Σ_t δ_{b,t} a_{b,t}ᵀ in registers (``tl.dot``: wgmma on Hopper, mma elsewhere), adds ‖tile‖² to a
partial norm of b and the tile into its gradient accumulator: the products never reach memory, and the only
work beyond the weight-gradient GEMM is a square-and-sum per tile and example (the floor of
``shared/reference/psgnorm-anchors.md``). Partial norms are summed afterwards (deterministic); when the tiles
alone are too few to fill the GPU the examples are split over a second grid axis, each split writing its own
gradient slice, summed afterwards.

Used for bfloat16/float16 inputs on CUDA with Triton (:mod:`~elasticlab.gns.triton_launch`), float32 ones with
:data:`FP32`; the cuBLAS ``seq_linear_outer_norms`` operator is the fallback and the reference. CI runs it
under Triton's interpreter (``tests/gns/test_triton_outer.py``).
"""
from __future__ import annotations

import torch

from elasticlab.gns import triton_launch
from elasticlab.gns.triton_launch import HAS_TMA, HAS_TRITON, run_tiles

if HAS_TRITON:  # pragma: no cover - depends on the torch build
    import triton
    import triton.language as tl
if HAS_TMA:  # pragma: no cover
    from triton.tools.tensor_descriptor import TensorDescriptor

# Switch for comparisons (benchmarks): False sends every call to the cuBLAS operator.
ENABLED = True
# float32 inputs too: exact float32 products ("ieee"), or TF32 where torch.backends.cuda.matmul.allow_tf32
# allows them, as the layer's own GEMM would. Off until measured on a GPU against cuBLAS (no product
# scratch, against the batched GEMM's B·Din·Dout floats: W2's +46% peak memory).
FP32 = False
# The loop that runs untuned (on a GPU :mod:`elasticlab.gns.triton_tune` times the loops per shape): True, one
# loop over (example, K step) pairs, pipelined across examples; False, a K loop per example.
FLAT = False
# Hopper's tensor-memory accelerator untuned (where :func:`tma_ok`): :func:`_outer_norms_tma_kernel` loads
# each example's (BK × tile) blocks by TMA descriptors (zero fill past T); a norm per gradient row.
TMA = False
# Each example's bias gradient Σ_t δ_{b,t} summed inside the kernel from the δ tiles it loads for the MMA
# (``outer_norms(..., bias=True)``, where :func:`fuses_bias`), instead of by a pass over δ (268 MB on G3's
# 1024→4096 layer). Untuned: off, and True forces it; tuned, off, each form is timed both ways. ptxas (sm_90):
# the default 128×128 TMA tiles at 203-214 registers (from 167), no spills (pointer loads: up to 255, 16-68 B
# spilled); each δ tile is read from shared memory into registers at every step, in every program.
FUSE_BIAS = False

if HAS_TRITON:
    @triton.jit
    def _owns_bias(eb, pid, num_n, Dout, BM: tl.constexpr, BIAS: tl.constexpr):
        """Whether this program sums its split's eb-th example's bias gradient: of the programs sharing its
        rows (``BIAS`` 1) or columns (2, mirrored), the one at eb modulo their count."""
        if BIAS == 2:
            return (eb % tl.cdiv(Dout, BM)) == pid // num_n
        return (eb % num_n) == pid % num_n

    @triton.jit
    def _bias_add(bsum, dt, at, own, T_AXIS: tl.constexpr, BIAS: tl.constexpr):
        """``bsum`` plus this K step's δ where this program owns the example's Σ_t δ_{b,t}: ``dt`` (t along
        ``T_AXIS``) for ``BIAS`` 1, the mirrored launch's ``at`` for 2. Summed over quarters of t (within a
        thread in the loaded layout: no exchange between threads); :func:`_bias_store` sums the rest."""
        if BIAS == 1:
            if own:
                if T_AXIS == 0:
                    bsum += tl.sum(tl.reshape(dt.to(tl.float32), (4, dt.shape[0] // 4, dt.shape[1])), axis=0)
                else:
                    bsum += tl.sum(tl.reshape(dt.to(tl.float32), (dt.shape[0], 4, dt.shape[1] // 4)), axis=1)
        if BIAS == 2:
            if own:
                bsum += tl.sum(tl.reshape(at.to(tl.float32), (4, at.shape[0] // 4, at.shape[1])), axis=0)
        return bsum

    @triton.jit
    def _bias_store(bias_ptr, bsum, b, offs_m, offs_n, m_ok, n_ok, own, Dout, Din, T_AXIS: tl.constexpr,
                    BIAS: tl.constexpr):
        """Example b's bias gradient to row b of ``bias`` (B, Dout) (mirrored: (B, Din)) where this program
        owns it; zeros for the next example."""
        b64 = tl.cast(b, tl.int64)
        if BIAS == 1:
            tl.store(bias_ptr + b64 * Dout + offs_m, tl.sum(bsum, axis=T_AXIS), mask=m_ok & own)
        if BIAS == 2:
            tl.store(bias_ptr + b64 * Din + offs_n, tl.sum(bsum, axis=0), mask=n_ok & own)
        return tl.zeros_like(bsum)

    @triton.jit
    def _k_step(a, d, bx, t0, T, m0, n0, offs_m, offs_n, offs_k, m_ok, n_ok, sa_b, sa_t, sa_i, sd_b, sd_t,
                sd_o, acc, bsum, own, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                PRECISION: tl.constexpr, BIAS: tl.constexpr, TMA: tl.constexpr):
        """One K step of example ``bx``'s tile, rows t0…t0+BK: acc + δ_bᵀ a_b over them (past T: zeros), and
        bsum (:func:`_bias_add`). ``TMA``: blocks of descriptors ``a``, ``d``; else loads from pointers by
        strides, ``bx`` the example's index in int64 (b·stride passes 2³¹ on inputs of over 2³¹ elements)."""
        if TMA:
            dt = d.load([bx, t0, m0]).reshape(BK, BM)                               # δ_b tile (BK, BM)
            at = a.load([bx, t0, n0]).reshape(BK, BN)
            return tl.dot(dt.T, at, acc, input_precision=PRECISION), _bias_add(bsum, dt, at, own, 0, BIAS)
        else:
            tk = t0 + offs_k
            k_ok = tk < T
            dt = tl.load(d + bx * sd_b + tk[None, :] * sd_t + offs_m[:, None] * sd_o,
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0)               # δ_bᵀ tile (BM, BK)
            at = tl.load(a + bx * sa_b + tk[:, None] * sa_t + offs_n[None, :] * sa_i,
                         mask=k_ok[:, None] & n_ok[None, :], other=0.0)               # a_b tile (BK, BN)
            return tl.dot(dt, at, acc, input_precision=PRECISION), _bias_add(bsum, dt, at, own, 1, BIAS)

    @triton.jit
    def _example_done(acc, gacc, partial_ptr, b, num_tiles, pid, WITH_GRAD: tl.constexpr):
        """Example b's tile is complete: its ‖tile‖² to partial[b, pid], the tile into the gradient
        accumulator (returned)."""
        tl.store(partial_ptr + b * num_tiles + pid, tl.sum(tl.sum(acc * acc, axis=1), axis=0))
        if WITH_GRAD:
            gacc += acc
        return gacc

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
    def _tile_done(acc, gacc, partial_ptr, b, num_tiles, pid, rows, BM: tl.constexpr, WITH_GRAD: tl.constexpr,
                   TMA: tl.constexpr):
        """The epilogue of example b's tile: a partial norm per gradient row (``TMA``), else one per tile."""
        if TMA:
            return _example_rows_done(acc, gacc, partial_ptr, b, num_tiles, pid, rows, BM, WITH_GRAD)
        else:
            return _example_done(acc, gacc, partial_ptr, b, num_tiles, pid, WITH_GRAD)

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
    def _tile_origin(pid, num_n, BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
        """(m0, n0, offs_m, offs_n): program pid's tile's first row and column of the gradient, its rows (over
        Dout) and columns (Din). Each form takes them in the order it did as a kernel of its own: ptxas
        schedules the rest by that order, and with it both forms compile to the same SASS as before."""
        if TMA:
            m0 = (pid // num_n) * BM
            n0 = (pid % num_n) * BN
            return m0, n0, m0 + tl.arange(0, BM), n0 + tl.arange(0, BN)
        else:
            pm, pn = pid // num_n, pid % num_n
            offs_m = pm * BM + tl.arange(0, BM)
            offs_n = pn * BN + tl.arange(0, BN)
            return pm * BM, pn * BN, offs_m, offs_n

    @triton.jit
    def _tile_norms(a, d, partial_ptr, grad_ptr, bias_ptr, B, T, Din, Dout, sa_b, sa_t, sa_i, sd_b, sd_t,
                    sd_o, SPLIT, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    WITH_GRAD: tl.constexpr, PRECISION: tl.constexpr, FLAT: tl.constexpr,
                    GRAD_T: tl.constexpr, OVERLAP: tl.constexpr, BIAS: tl.constexpr, TMA: tl.constexpr):
        """The body of both kernels: this program's (BM × BN) gradient tile over its split's examples, their
        partial norms, bias sums and gradient slice. ``TMA``: ``a``, ``d`` are descriptors (the strides
        unused) and the partial norms per gradient row."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_n = tl.cdiv(Din, BN)
        num_tiles = tl.num_programs(0)
        m0, n0, offs_m, offs_n = _tile_origin(pid, num_n, BM, BN, TMA)
        offs_k = tl.arange(0, BK)
        rows = tl.arange(0, BM)
        m_ok, n_ok = offs_m < Dout, offs_n < Din
        gacc = tl.zeros((BM, BN), dtype=tl.float32)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if BIAS == 2:
            bsum = tl.zeros((BK // 4, BN), dtype=tl.float32)
        elif TMA:
            bsum = tl.zeros((BK // 4, BM), dtype=tl.float32)
        else:
            bsum = tl.zeros((BM, BK // 4), dtype=tl.float32)
        if FLAT:
            # One loop over (example, K step) pairs, as the weight-gradient GEMM's single K loop over B·T
            # rows: the software pipeline keeps loading across examples instead of draining at the end of
            # each one's T/BK steps; the per-example epilogue runs on the last step of each example.
            k_tiles = tl.cdiv(T, BK)
            n_b = tl.cdiv(B - split, SPLIT)
            if OVERLAP:
                done = tl.zeros((BM, BN), dtype=tl.float32)      # the last finished example's tile
            for it in range(0, n_b * k_tiles):
                eb = it // k_tiles
                ki = it - eb * k_tiles
                b = split + eb * SPLIT
                bx = b if TMA else tl.cast(b, tl.int64)         # (as _k_step takes it)
                own = _owns_bias(eb, pid, num_n, Dout, BM, BIAS)
                acc, bsum = _k_step(a, d, bx, ki * BK, T, m0, n0, offs_m, offs_n, offs_k, m_ok, n_ok, sa_b,
                                    sa_t, sa_i, sd_b, sd_t, sd_o, acc, bsum, own, BM, BN, BK, PRECISION, BIAS,
                                    TMA)
                if OVERLAP:
                    if (ki == 0) & (eb > 0):                      # the previous example's norm
                        _example_rows_done(done, gacc, partial_ptr, b - SPLIT, num_tiles, pid, rows, BM,
                                           False)
                if ki == k_tiles - 1:
                    if OVERLAP:
                        if WITH_GRAD:
                            gacc += acc
                        # computed here, after the tile's wait: a bare copy would become a select on the tile
                        # in flight, which waits for it at every step
                        done = acc + 0.0
                    else:
                        gacc = _tile_done(acc, gacc, partial_ptr, b, num_tiles, pid, rows, BM, WITH_GRAD, TMA)
                    acc = tl.zeros((BM, BN), dtype=tl.float32)
                    if BIAS != 0:
                        bsum = _bias_store(bias_ptr, bsum, b, offs_m, offs_n, m_ok, n_ok, own, Dout, Din,
                                           1 - TMA, BIAS)
            if OVERLAP:
                last = split + (n_b - 1) * SPLIT
                _example_rows_done(done, gacc, partial_ptr, last, num_tiles, pid, rows, BM, False)
        else:
            # A loop over the examples around a K loop over each one's T rows.
            for b in range(split, B, SPLIT):
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                bx = b if TMA else tl.cast(b, tl.int64)
                own = _owns_bias((b - split) // SPLIT, pid, num_n, Dout, BM, BIAS)
                for t0 in range(0, T, BK):
                    acc, bsum = _k_step(a, d, bx, t0, T, m0, n0, offs_m, offs_n, offs_k, m_ok, n_ok, sa_b,
                                        sa_t, sa_i, sd_b, sd_t, sd_o, acc, bsum, own, BM, BN, BK, PRECISION,
                                        BIAS, TMA)
                gacc = _tile_done(acc, gacc, partial_ptr, b, num_tiles, pid, rows, BM, WITH_GRAD, TMA)
                if BIAS != 0:
                    bsum = _bias_store(bias_ptr, bsum, b, offs_m, offs_n, m_ok, n_ok, own, Dout, Din, 1 - TMA,
                                       BIAS)
        if WITH_GRAD:                                        # norms only: no gradient buffer at all
            _store_grad(grad_ptr, gacc, tl.cast(split, tl.int64) if TMA else split, offs_m, offs_n, m_ok,
                        n_ok, Dout, Din, GRAD_T)

    @triton.jit
    def _outer_norms_kernel(a_ptr, d_ptr, partial_ptr, grad_ptr, bias_ptr, B, T, Din, Dout,
                            sa_b, sa_t, sa_i, sd_b, sd_t, sd_o, SPLIT,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WITH_GRAD: tl.constexpr,
                            PRECISION: tl.constexpr, FLAT: tl.constexpr, GRAD_T: tl.constexpr,
                            BIAS: tl.constexpr = 0):
        """Operands by pointers and strides (any layout); a partial norm per tile: partial is (B, tiles).
        ``BIAS``: 0 none; 1 each Σ_t δ_{b,t} to bias (B, Dout); 2 mirrored (δ is ``a``), (B, Din)."""
        _tile_norms(a_ptr, d_ptr, partial_ptr, grad_ptr, bias_ptr, B, T, Din, Dout, sa_b, sa_t, sa_i, sd_b,
                    sd_t, sd_o, SPLIT, BM, BN, BK, WITH_GRAD, PRECISION, FLAT, GRAD_T, False, BIAS, False)

    @triton.jit
    def _outer_norms_tma_kernel(a_desc, d_desc, partial_ptr, grad_ptr, bias_ptr, B, T, Din, Dout, SPLIT,
                                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WITH_GRAD: tl.constexpr,
                                PRECISION: tl.constexpr, FLAT: tl.constexpr, GRAD_T: tl.constexpr,
                                OVERLAP: tl.constexpr, BIAS: tl.constexpr = 0):
        """:func:`_outer_norms_kernel` with operands from TMA descriptors over a (B, T, Din) and d (B, T,
        Dout) (blocks [1, BK, BN] and [1, BK, BM]) and a partial norm per gradient row: partial is (B, tiles,
        BM). ``OVERLAP`` (flat loop): a second accumulator holds each finished example's tile, whose norm
        (squares, row sums, their store) is taken in the next example's first K step, after that step's MMA
        is issued, so that it runs on the CUDA cores while the tensor cores work, instead of between them."""
        _tile_norms(a_desc, d_desc, partial_ptr, grad_ptr, bias_ptr, B, T, Din, Dout, 0, 0, 0, 0, 0, 0, SPLIT,
                    BM, BN, BK, WITH_GRAD, PRECISION, FLAT, GRAD_T, OVERLAP, BIAS, True)


# Where the fused kernel beat cuBLAS batched GEMMs + fold (benchmarks/bench_seq_linear_cuda.py, H100, bf16,
# 2026-11-26): layers with at least this many 128×128 gradient tiles (G1's 768→50304 head: 1.71× the weight
# GEMM against 2.26×; G3's 1024↔4096 at B=64: 1.94× against 2.2×) or short sequences (T=128: 2.86× against
# 4.02×). On G1's block layers (36–144 tiles, T=1024) cuBLAS won (2.07–2.23× against 2.27–2.77×).
MIN_TILES, MAX_SHORT_T = 200, 128


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
    split = triton_launch.splits(B, tiles, device)
    return 4 * (B * tiles * (bm if tma else 1) + (split - 1) * Dout * Din)


def outer_norms(a: torch.Tensor, d: torch.Tensor, with_grad: bool, config: tuple | None = None,
                bias: bool = False):
    """(‖G_b‖² (B,) float32, Σ_b G_b (Dout, Din) float32 or None) for a (B,T,Din), d (B,T,Dout), and with
    ``bias`` a third entry: each example's bias gradient Σ_t δ_{b,t} (B, Dout) float32, summed in the kernel
    from the δ tiles it loads for the MMA where :func:`fuses_bias`, else by ``d.sum(1)`` after it. ``config``:
    (BM, BN, BK, num_warps, num_stages[, loop[, tma[, swap[, fuse]]]]) instead of :func:`_config`'s; ``loop``:
    False nested, True flat, :data:`OVERLAP` (TMA only), else :data:`FLAT`'s; ``tma``: else
    :data:`TMA`'s, where :func:`tma_ok`; ``swap``: the kernel on the mirrored shape, G_bᵀ (rows over Din,
    same norms), each gradient tile stored transposed so that the gradient is (Dout, Din) still; ``fuse``:
    the bias sums' way, in place of :data:`FUSE_BIAS` (:func:`fuses_bias`).
    ``with_grad=False``: no gradient buffer, no gradient tile stored (the partial norms are all it writes)."""
    B, T, Din = a.shape
    Dout = d.shape[2]
    bm, bn, bk, warps, stages, *rest = config or _config(Din, Dout, a.dtype)
    loop = int(rest[0]) if rest else int(FLAT)
    if loop not in LOOPS:
        raise ValueError("outer_norms: loop must be " + ", ".join(f"{k} ({v})" for k, v in LOOPS.items())
                         + f", got {rest[0]!r}")
    if bias and not fuses_bias(config or (bm, bn, bk, warps, stages, loop)):
        return (*outer_norms(a, d, with_grad, config), d.sum(1, dtype=torch.float32))
    db = torch.empty(B, Dout, device=a.device, dtype=torch.float32) if bias else None
    if B == 0 or T == 0 or Din == 0 or Dout == 0:
        z = torch.zeros(B, device=a.device)
        out = z, (torch.zeros(Dout, Din, device=a.device) if with_grad else None)
        return (*out, db.zero_()) if bias else out
    tma = bool(rest[1]) if len(rest) > 1 else TMA
    swap = len(rest) > 2 and bool(rest[2])
    if swap:                                      # the mirror: rows over Din, the gradient stored transposed
        a, d, Din, Dout = d, a, Dout, Din
    meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=bool(with_grad), PRECISION=triton_launch.precision(a.dtype),
                FLAT=loop != 0, GRAD_T=swap, BIAS=(2 if swap else 1) if bias else 0, num_warps=warps,
                num_stages=stages)
    tiles = triton.cdiv(Dout, bm) * triton.cdiv(Din, bn)
    shape = (Din, Dout) if swap else (Dout, Din)                      # the layer's (out, in) either way
    if tma and tma_ok(a, d):
        operands = (TensorDescriptor(a, list(a.shape), list(a.stride()), [1, bk, bn]),
                    TensorDescriptor(d, list(d.shape), list(d.stride()), [1, bk, bm]))
        out = run_tiles(_outer_norms_tma_kernel, a, d, (B, T, Din, Dout), tiles, *shape, with_grad,
                        dict(meta, OVERLAP=loop == OVERLAP), operands=operands, rows_per_tile=bm,
                        outputs=(db,))
    elif loop == OVERLAP:
        raise ValueError("outer_norms: the overlapped loop needs TMA loads (tma=True where tma_ok)")
    else:
        out = run_tiles(_outer_norms_kernel, a, d, (B, T, Din, Dout, *a.stride(), *d.stride()), tiles, *shape,
                        with_grad, meta, outputs=(db,))
    return (*out, db) if bias else out


def fuses_bias(config: tuple) -> bool:
    """Whether a launch in ``config`` (as :func:`outer_norms` takes it) sums the bias gradients in the kernel:
    its ``fuse`` entry, else :data:`FUSE_BIAS`, on; a tile of at most 128×128 and not the overlapped loop."""
    loop, fuse = int(config[5]) if len(config) > 5 else int(FLAT), config[8] if len(config) > 8 else FUSE_BIAS
    return bool(fuse) and config[0] * config[1] <= 128 * 128 and loop != OVERLAP


def tma_ok(a: torch.Tensor, d: torch.Tensor) -> bool:
    """Whether TMA descriptors can address these operands: Triton's descriptors present, a GPU with the tensor
    memory accelerator (compute capability 9 or later; CPU tensors: Triton's interpreter), one floating
    dtype of 2 or 4 bytes, unit last strides, and 16-byte aligned bases and outer strides (else the pointer
    kernel)."""
    if not HAS_TMA or a.dtype != d.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if a.is_cuda and triton_launch.props(a.device).major < 9:
        return False
    for t in (a, d):
        es = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]):
            return False
    return True


