"""Per-example norms of a sequence Linear by the Gram form, fused in one Triton kernel ("ghost norm").

‖G_b‖² = ‖Σ_t δ_{b,t} a_{b,t}ᵀ‖² = Σ_{t,s} (a_{b,t}·a_{b,s}) (δ_{b,t}·δ_{b,s}) (Li et al. 2022, Sec. 4;
Goodfellow 2015): the elementwise product of the two T×T Gram matrices of example b, summed. Both Grams are
symmetric, so each program takes one (BT × BT) block pair (i ≤ j) of one example: it forms block (i, j) of
a_b a_bᵀ (a K loop over Din) and of δ_b δ_bᵀ (a K loop over Dout) in registers, and writes Σ of their product,
doubled off the diagonal. The diagonal pairs (i = j) have a launch of their own, which loads each operand
block once where the others load two. No T×T matrix reaches memory, and the upper triangle alone is computed:
T²·(Din + Dout)·(nt + 1)/(2·nt) multiply-adds an example (nt = T/BT blocks) against the outer form's
T·Din·Dout, with long K
loops, where the fused outer kernel (:mod:`elasticlab.gns.triton_outer`) runs a K loop of only T per example
and tile. The weight gradient is not a by-product here: the form pairs the kernel with the plain
weight-gradient GEMM. :mod:`elasticlab.gns.triton_tune` times it beside the outer kernel's variants where its
multiply-adds are fewer (:func:`worthwhile`). Runs on CUDA, or on the CPU under Triton's interpreter (tests).
"""
from __future__ import annotations

import torch

from elasticlab.gns import triton_launch
from elasticlab.gns.triton_launch import HAS_TRITON

if HAS_TRITON:  # pragma: no cover - depends on the torch build
    import triton
    import triton.language as tl

    @triton.jit
    def _gram_block(ptr, base, s_t, s_k, ri, rj, i_ok, j_ok, K,
                    BT: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, DIAG: tl.constexpr):
        """Block (rows ri, rows rj) of x xᵀ for one example's (T, K) matrix x at ``ptr + base``: a K loop.
        ``DIAG`` (ri = rj): one operand block loaded a step, used as both."""
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BT, BT), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + offs_k
            k_ok = k < K
            xi = tl.load(ptr + base + ri[:, None] * s_t + k[None, :] * s_k,
                         mask=i_ok[:, None] & k_ok[None, :], other=0.0)
            if DIAG:
                xj = xi
            else:
                xj = tl.load(ptr + base + rj[:, None] * s_t + k[None, :] * s_k,
                             mask=j_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(xi, tl.trans(xj), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _ghost_norms_kernel(a_ptr, d_ptr, pairs_ptr, partial_ptr, T, Din, Dout, NPAIRS, P0,
                            sa_b, sa_t, sa_i, sd_b, sd_t, sd_o,
                            BT: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, DIAG: tl.constexpr):
        """Program (p, b): block pair P0 + p of the table (i ≤ j; all diagonal with ``DIAG``, none without) of
        example b; writes Σ (a aᵀ)_ij ⊙ (δ δᵀ)_ij, doubled off the diagonal, to partial[b, P0 + p]."""
        p, b = P0 + tl.program_id(0), tl.program_id(1)
        i, j = tl.load(pairs_ptr + 2 * p), tl.load(pairs_ptr + 2 * p + 1)
        b64 = tl.cast(b, tl.int64)
        ri, rj = i * BT + tl.arange(0, BT), j * BT + tl.arange(0, BT)
        i_ok, j_ok = ri < T, rj < T
        ga = _gram_block(a_ptr, b64 * sa_b, sa_t, sa_i, ri, rj, i_ok, j_ok, Din, BT, BK, PRECISION, DIAG)
        gd = _gram_block(d_ptr, b64 * sd_b, sd_t, sd_o, ri, rj, i_ok, j_ok, Dout, BT, BK, PRECISION, DIAG)
        total = tl.sum(tl.sum(ga * gd, axis=1), axis=0)
        tl.store(partial_ptr + b * NPAIRS + p, total if DIAG else 2.0 * total)


_PAIRS: dict[tuple, torch.Tensor] = {}            # (nt, device) -> the (i, j) block pairs, i <= j, as int32


def _pairs(nt: int, device: torch.device) -> torch.Tensor:
    """The nt·(nt+1)/2 upper-triangle block pairs (i, j) as a flat int32 tensor on ``device`` (made once), the
    nt diagonal ones first, which the kernel's first grid axis indexes: no program is launched for the lower
    triangle, and no branch wraps the K loops (which would keep Triton from pipelining them)."""
    key = (nt, device)
    t = _PAIRS.get(key)
    if t is None:
        ij = [(i, i) for i in range(nt)] + [(i, j) for i in range(nt) for j in range(i + 1, nt)]
        t = _PAIRS[key] = torch.tensor(ij, dtype=torch.int32).reshape(-1).to(device)
    return t


def worthwhile(T: int, din: int, dout: int) -> bool:
    """Whether the fused Gram form's multiply-adds (the upper triangle's block pairs, blocks of
    :func:`_config`) are fewer than the outer form's, T·Din·Dout an example: what makes it worth timing."""
    bt, nt = _blocks(T)
    return nt * (nt + 1) // 2 * bt * bt * (din + dout) < T * din * dout


def _blocks(T: int) -> tuple[int, int]:
    """(BT, nt): rows a block, 128 (64 for short sequences), and blocks along T."""
    bt = 128 if T > 64 else 64
    return bt, -(-T // bt)


def _config(T: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BT, BK, num_warps, num_stages): :func:`_blocks`' rows, K steps of 64; 16-bit operands take 4
    pipeline stages, float32 ones 3 (shared memory)."""
    bt = _blocks(T)[0]
    return bt, 64, 8 if bt == 128 else 4, 4 if dtype in (torch.bfloat16, torch.float16) else 3


def tuned_configs(T: int, dtype: torch.dtype) -> dict[str, tuple[int, int, int, int]]:
    """{name: config} that :mod:`elasticlab.gns.triton_tune` (and :mod:`~elasticlab.gns.calibrate`) time for
    this form: ``ghost``, :func:`_config`'s; for 16-bit operands also ``ghost-k128``, K steps of 128 in 3
    stages (half the loop's iterations and barriers, 192 KB of operand buffers). Neither has run on a GPU yet:
    the tuner picks on the device."""
    out = {"ghost": _config(T, dtype)}
    if dtype in (torch.bfloat16, torch.float16):
        bt, _, warps, _ = out["ghost"]
        out["ghost-k128"] = (bt, 128, warps, 3)
    return out


def ghost_norms(a: torch.Tensor, d: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """‖G_b‖² (B,) float32 of a (B, T, Din) and d (B, T, Dout) on the Triton device (CUDA, or the CPU under
    the interpreter), both of one dtype; ``config``: (BT, BK, num_warps, num_stages) instead of
    :func:`_config`'s. Float32 products take TF32 as torch's matmul setting says, as the layer's GEMM does."""
    if a.dim() != 3 or d.dim() != 3 or a.shape[:2] != d.shape[:2] or a.dtype != d.dtype:
        raise ValueError(f"ghost_norms: expected a (B, T, Din) and d (B, T, Dout) of one dtype, got "
                         f"{tuple(a.shape)} {a.dtype} and {tuple(d.shape)} {d.dtype}")
    B, T, Din = a.shape
    Dout = d.shape[2]
    if B == 0 or T == 0 or Din == 0 or Dout == 0:
        return torch.zeros(B, device=a.device)
    bt, bk, warps, stages = config or _config(T, a.dtype)
    nt = triton.cdiv(T, bt)
    pairs = _pairs(nt, a.device)
    npairs = pairs.numel() // 2
    partial = torch.empty(B, npairs, device=a.device, dtype=torch.float32)
    meta = dict(BT=bt, BK=bk, PRECISION=triton_launch.precision(a.dtype), num_warps=warps, num_stages=stages)
    for p0, n, diag in ((0, nt, True), (nt, npairs - nt, False)):      # the diagonal pairs, then the others
        if n:
            triton_launch.launch(_ghost_norms_kernel, (n, B), a.device,
                                (a, d, pairs, partial, T, Din, Dout, npairs, p0, *a.stride(), *d.stride()),
                                dict(meta, DIAG=diag))
    return partial.sum(1)


def scratch_bytes(B: int, T: int) -> int:
    """Bytes :func:`ghost_norms` allocates beyond its result: the (B, block pairs) partial sums."""
    nt = _blocks(T)[1]
    return 4 * B * nt * (nt + 1) // 2
