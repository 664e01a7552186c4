"""Per-shape choice among the Triton forms of a sequence Linear's norms, timed on the GPU that runs them.

:mod:`elasticlab.gns.triton_outer` has four variants of one computation: two loops (``flat``: one loop over
(example, K step) pairs; nested: a K loop per example) × two ways of loading the operands (pointers, or
Hopper's TMA descriptors where :func:`~elasticlab.gns.triton_outer.tma_ok`), and with TMA loads on wide 16-bit
layers a wider tile too (:data:`WIDE`, "-wide") and a deeper K step (:data:`DEEP`, "-deep"), and a third loop
(:data:`~elasticlab.gns.triton_outer.OVERLAP`, "-overlap"); each also on the layer's mirrored shape ("-swap",
the gradient's rows over Din). Beside them, where its multiply-adds are fewer
(:func:`elasticlab.gns.triton_gram.worthwhile`) and :data:`GHOST` is on, the fused Gram form ("ghost":
:func:`elasticlab.gns.triton_gram.ghost_norms` and the plain weight-gradient GEMM, whose gradient is then in
the inputs' dtype, as the plain layer's). The H100 sweeps of ``bench_seq_linear_cuda.py`` ranked the variants
differently from shape to shape (session 10: the flat loop won on W3.up only), which one fixed choice cannot
follow. So, as ``torch.backends.cudnn.benchmark`` does for convolution algorithms, with :data:`ENABLED` the
first call of each (shape, dtype, device) runs every form on the layer's own operands, each once to warm up
(Triton compiles there) and then :data:`REPEATS` times, keeps the fastest for that shape and returns its
result; later calls run the kept one. The forms compute the same sums in other orders, so any of them is a
valid result. Untuned (off, under ``torch.compile``, while a CUDA graph is captured, on the CPU),
:data:`~elasticlab.gns.triton_outer.FLAT` and :data:`~elasticlab.gns.triton_outer.TMA` say which variant runs.
``ELASTICLAB_TRITON_TMA=0`` in the environment keeps the TMA variants out (:data:`TMA`),
``ELASTICLAB_TRITON_GHOST=0`` the fused Gram form (:data:`GHOST`; calibration's candidates too).
:func:`tunings` lists what was measured.
"""
from __future__ import annotations

import functools
import os

import torch

from elasticlab.gns import timing, triton_gram, triton_outer

ENABLED = True
REPEATS = 3
TMA = os.environ.get("ELASTICLAB_TRITON_TMA", "1") != "0"
GHOST = os.environ.get("ELASTICLAB_TRITON_GHOST", "1") != "0"

# A wider tile, timed beside :func:`~elasticlab.gns.triton_outer._config`'s on 16-bit layers wide enough to
# fill it (:func:`wide_ok`), in the TMA form: 128×256, 8 warps, 3 stages. It loads a quarter fewer
# operand bytes per multiply-add; its two float32 tiles (the example's and the gradient's) need over 255
# registers a thread, so it spills about 170 B in the epilogue (ptxas for sm_90; .ci/triton_aot.py bounds
# it). On an H200 (2026-11-28, bench_seq_linear_cuda.py's sweep, bf16) it was still the fastest of 24
# configs on G3.up (TMA, flat loop: 1.32× the weight-gradient GEMM, against 1.39× for the default tile) and on
# G1.head (1.19× against 1.40×). Not a default: the tuner keeps it only where it times fastest.
WIDE = (128, 256, 64, 8, 3)


def wide_ok(din: int, dout: int, dtype: torch.dtype) -> bool:
    """Whether :data:`WIDE` is a candidate for a (Din → Dout) layer of ``dtype``: 16-bit operands, Din ≥ 256
    and Dout ≥ 128 (a narrower layer would leave most of the tile empty)."""
    return dtype in (torch.bfloat16, torch.float16) and din >= WIDE[1] and dout >= WIDE[0]


# A K step of 128, timed beside the default tile on 16-bit layers, in the TMA flat loop: 128×128×128, 8 warps,
# 3 stages (192 KB of shared memory; no spills, ptxas for sm_90 with Triton 3.6 and 3.8). The H200 sweep of
# 2026-11-28 (G3.up, TMA flat loop, bf16) reads as a loop bound by its per-step waits and load latency rather
# than by its MMAs: the same multiply-adds in K steps of 32 took 1.59× the time of steps of 64 (2.21× against
# 1.39× the weight-gradient GEMM), and a fourth stage of 64 took 15% off the third's (1.63× → 1.39×). Steps of
# 128 halve the loop's turns (and its four block-wide barriers, its mbarrier wait, its two TMA issues), and
# three stages keep two steps of twice the MMA work in flight. It moves the same operand bytes as the default
# tile, though (G3.up: 4.3 GB from L2 into shared memory, which the default tile moved at 8.8 TB/s and the
# 4-warp tiles of the same sweep, with 1.5× the bytes, at up to 10.9 TB/s): if L2 bandwidth is the ceiling, no
# 128×128 tile gets below about 1.1× that GEMM. Not yet timed: kept only where fastest.
DEEP = (128, 128, 128, 8, 3)


def deep_ok(T: int, din: int, dout: int, dtype: torch.dtype) -> bool:
    """Whether :data:`DEEP` is a candidate for a (Din → Dout) layer of ``dtype`` over T positions an example:
    16-bit operands, T ≥ 128 (a shorter example would be one K step mostly of padding) and Din, Dout ≥ 128."""
    return (dtype in (torch.bfloat16, torch.float16) and T >= DEEP[2] and din >= DEEP[1]
            and dout >= DEEP[0])


_CHOSEN: dict[tuple, tuple] = {}                  # key -> (name, config or None) of the form measured fastest
_TIMES: dict[tuple, dict[str, float]] = {}        # key -> {form: seconds}


def active(a: torch.Tensor) -> bool:
    """Whether a call on ``a`` may measure its shape's forms: :data:`ENABLED`, on CUDA, eager (a traced call
    or a captured CUDA graph would record the measuring)."""
    return follows(a) and not torch.cuda.is_current_stream_capturing()


def follows(a: torch.Tensor) -> bool:
    """Whether a call on ``a`` runs the form kept for its shape, once measured: :data:`ENABLED`, on CUDA, not
    traced. While a CUDA graph is captured too (warmed up eagerly first, as captures are): the graph records
    the kept form's launch, only the measuring is left out."""
    return ENABLED and a.is_cuda and not torch.compiler.is_compiling()


def variant_name(config: tuple) -> str:
    """Which variant a full config (BM, BN, BK, warps, stages, loop, tma[, swap]) runs: "pointer" or "tma",
    then the loop's name in :data:`~elasticlab.gns.triton_outer.LOOPS` ("-nested", "-flat", "-overlap"),
    then "-wide" for the tile :data:`WIDE` or "-deep" for :data:`DEEP`, then "-swap" for the mirrored
    shape, then "-fusedbias" where its ninth entry fuses the bias sums in."""
    tile = tuple(config[:5])
    return (("tma" if config[6] else "pointer") + "-" + triton_outer.LOOPS[int(config[5])]
            + ("-wide" if tile == WIDE else "-deep" if tile == DEEP else "")
            + ("-swap" if len(config) > 7 and config[7] else "")
            + ("-fusedbias" if len(config) > 8 and config[8] else ""))


def _oriented(T: int, din: int, dout: int, dtype: torch.dtype, tma: bool, swap: bool) -> list[tuple]:
    """The configs of one orientation of a (Din → Dout) layer over T positions (``swap``: its mirror, Dout →
    Din)."""
    if swap:
        din, dout = dout, din
    base = triton_outer._config(din, dout, dtype)[:5]
    out = [base + (flat, t) for t in ((False, True) if tma else (False,)) for flat in (False, True)]
    if tma:
        out.append(base + (triton_outer.OVERLAP, True))
    if tma and wide_ok(din, dout, dtype):
        out += [WIDE + (flat, True) for flat in (False, True)]
    if tma and deep_ok(T, din, dout, dtype):
        out.append(DEEP + (True, True))
    return [c + (True,) for c in out] if swap else out


def candidates(a: torch.Tensor, d: torch.Tensor) -> list[tuple]:
    """The full configs timed for these operands: the tile of :func:`~elasticlab.gns.triton_outer._config`,
    both loops, and TMA loads too where :data:`TMA` and the descriptors address the operands, with TMA also
    the overlapped loop (:data:`~elasticlab.gns.triton_outer.OVERLAP`); with TMA loads, where
    :func:`wide_ok`, the tile :data:`WIDE` in the two plain loops as well, and where :func:`deep_ok`, the K
    step of :data:`DEEP` in the flat loop. Where Din ≠ Dout, each again on the mirrored shape ("-swap": the
    gradient's rows over Din; H200, 2026-11-28: G3's 4096 → 1024 layer took 1.72× the weight-gradient GEMM
    where its mirror, 1024 → 4096, took 1.39×, in the same variant)."""
    T, din, dout = a.shape[1], a.shape[2], d.shape[2]
    tma = TMA and triton_outer.tma_ok(a, d)
    out = _oriented(T, din, dout, a.dtype, tma, False)
    return out + (_oriented(T, din, dout, a.dtype, tma, True) if din != dout else [])


def ghost(a: torch.Tensor, d: torch.Tensor, with_grad: bool, config: tuple | None = None, bias: bool = False):
    """The fused Gram form (block ``config`` as :func:`~elasticlab.gns.triton_gram.ghost_norms` takes it):
    (‖G_b‖² (B,) float32, the weight gradient by one GEMM in the inputs' dtype, or None), and with ``bias``
    the per-example bias gradients Σ_t δ_{b,t} (B, Dout) float32, by a reduction over δ."""
    norms = triton_gram.ghost_norms(a, d, config)
    grad = d.reshape(-1, d.shape[2]).t().mm(a.reshape(-1, a.shape[2])) if with_grad else None
    return (norms, grad, d.sum(1, dtype=torch.float32)) if bias else (norms, grad)


def scratch_bytes(a: torch.Tensor, d: torch.Tensor, config: tuple) -> int:
    """Modelled bytes a form of :func:`forms` (its ``config``) allocates beyond its results: the outer
    kernel's partials and split gradients (its mirror: those of the mirrored shape), or the fused Gram form's
    partial sums."""
    B, T, din = a.shape
    dout = d.shape[2]
    if len(config) == 4:                                        # a Gram-kernel block config
        return triton_gram.scratch_bytes(B, T)
    swap = len(config) > 7 and config[7]
    rows, cols = (din, dout) if swap else (dout, din)
    tma = bool(config[6]) and triton_outer.tma_ok(a, d)
    return triton_outer.scratch_bytes(B, cols, rows, a.device, tuple(config[:5]), tma=tma)


def forms(a: torch.Tensor, d: torch.Tensor, with_grad: bool, bias: bool = False) -> dict[str, tuple]:
    """{name: (call, config)} of the forms timed for these operands: :func:`candidates`, and where
    :data:`GHOST` and :func:`~elasticlab.gns.triton_gram.worthwhile`, the fused Gram form in each of
    :func:`~elasticlab.gns.triton_gram.tuned_configs` (names starting "ghost"); with ``bias`` each also
    returns the per-example bias gradients (so that their cost is in every form's time), summed after the
    kernel, and, unless :data:`~elasticlab.gns.triton_outer.FUSE_BIAS` fuses them everywhere, each candidate
    that can sum them from its δ tiles (:func:`~elasticlab.gns.triton_outer.fuses_bias`) once more that way
    ("-fusedbias")."""
    configs = candidates(a, d)
    if bias and not triton_outer.FUSE_BIAS:             # the bias sums each way, where a form can fuse them
        configs += [f for f in (c + (False,) * (8 - len(c)) + (True,) for c in configs)
                    if triton_outer.fuses_bias(f)]
    out = {variant_name(c): (functools.partial(triton_outer.outer_norms, a, d, with_grad, c, bias), c)
           for c in configs}
    if GHOST and triton_gram.worthwhile(*a.shape[1:], d.shape[2]):
        for name, c in triton_gram.tuned_configs(a.shape[1], a.dtype).items():
            out[name] = (functools.partial(ghost, a, d, with_grad, c, bias), c)
    return out


def outer_norms(a: torch.Tensor, d: torch.Tensor, with_grad: bool, bias: bool = False):
    """(‖G_b‖² (B,) float32, Σ_b G_b or None[, with ``bias`` the per-example bias gradients (B, Dout)]) by the
    form measured fastest for this shape (measured at its first call, whose result is the winner's);
    :func:`elasticlab.gns.triton_outer.outer_norms` untuned where not :func:`follows`, and where nothing is
    kept for the shape yet while not :func:`active` (a CUDA graph being captured). A form that raises (a tile
    over the device's shared memory, say) is left out with a warning; if all raise, the last error
    propagates."""
    if not follows(a):
        return triton_outer.outer_norms(a, d, with_grad, bias=bias)
    tma = TMA and triton_outer.tma_ok(a, d)
    key = (*a.shape, d.shape[2], a.dtype, a.device, bool(with_grad), tma, GHOST,
           ("fused" if triton_outer.FUSE_BIAS else "both") if bias else None)
    kept = _CHOSEN.get(key)
    if kept is not None:
        name, config = kept
        if name.startswith("ghost"):
            return ghost(a, d, with_grad, config, bias)
        return triton_outer.outer_norms(a, d, with_grad, config, bias)
    if not active(a):
        return triton_outer.outer_norms(a, d, with_grad, bias=bias)
    found = forms(a, d, with_grad, bias)
    shape = tuple(key[:4])
    name, out, times = timing.fastest({n: run for n, (run, _) in found.items()}, a.device, REPEATS,
                                      f"triton_tune: forms left out for (B, T, Din, Dout) = {shape}",
                                      desc=f"triton_tune {'x'.join(map(str, shape))}")
    _CHOSEN[key], _TIMES[key] = (name, found[name][1]), times
    return out


def tunings() -> dict[tuple, dict[str, float]]:
    """{(B, T, Din, Dout, dtype, device, with_grad, TMA variants timed, ghost allowed, bias sums: None,
    "fused" (:data:`~elasticlab.gns.triton_outer.FUSE_BIAS`: in the kernel wherever it can) or "both" (each
    way timed)): {form: seconds}} of every shape tuned so far; the fastest is the one kept."""
    return {k: dict(v) for k, v in _TIMES.items()}


def chosen() -> dict[tuple, str]:
    """{key (as :func:`tunings`'): the form kept}."""
    return {k: name for k, (name, _) in _CHOSEN.items()}


def kept() -> dict[tuple, tuple]:
    """{key: (form, config or None)} of every shape chosen so far (what :mod:`elasticlab.gns.choices`
    saves)."""
    return dict(_CHOSEN)


def keep(key: tuple, choice: tuple, times: dict[str, float]) -> None:
    """Takes ``choice`` (form, config) for ``key`` as if measured (``times``): later calls of that shape run
    it without timing (what :mod:`elasticlab.gns.choices` loads)."""
    _CHOSEN[key], _TIMES[key] = (choice[0], None if choice[1] is None else tuple(choice[1])), dict(times)


def reset() -> None:
    """Forgets every choice: the next call of each shape measures again."""
    _CHOSEN.clear()
    _TIMES.clear()
