"""The sequence-Linear per-example norm operators on CUDA against the weight-gradient GEMM they fuse with.

For layer shapes of the GPU workloads (G1 GPT-2-small, G3 wide block, W2/W3), each method's time as a ratio to
the plain weight-gradient GEMM Σ_b δ_bᵀ a_b (one cuBLAS GEMM over B·T rows, in the same dtype), in one run:
``triton`` (fused, products in registers: on tensor cores in bfloat16, exact FMA products in float32; a K
loop per example), ``flat`` (the same kernel with one loop over (example, K step) pairs, pipelined across
examples: ``triton_outer.FLAT``), ``tma`` and ``tma-flat`` (both loops with the operands loaded through TMA
descriptors and per-row partial norms: ``triton_outer.TMA``), ``ghost`` (the fused Gram kernel of
``triton_gram`` and the weight-gradient GEMM it needs), ``tuned`` (what the layers run: the form
``triton_tune`` keeps for the shape, named at the end of its row), ``cublas`` (batched GEMM + one fold
pass; the compiled operator), ``gram`` (Gram form + the weight-gradient GEMM, which the Gram form still
needs), and ``bmm`` (the batched GEMM of ``cublas`` alone, as torch.bmm: the difference is the fold and its
allocations). Each method's peak scratch (MB allocated by one call, outputs included) is printed beside it.
Then sweeps: the cuBLAS form's chunk budget (``chunks``: :data:`CHUNKS`), the fused Gram kernel's blocks
(``ghost``: :data:`GHOST_SWEEP`), and the outer Triton kernel's tiles and variants (``sweep``; with its lines
``triton-gemm``, ``bias-apart``/``bias-fused`` and ``per-sm-1``/``per-sm-2``: the examples split for one
program an SM or two, :data:`SPLIT_CONFIGS`; and ``tma-flat TB/s``, ``gemm TB/s``: the L2 bandwidth each TMA
flat launch and each plain Triton GEMM drew, :func:`operand_bytes` over its time).
Every method is first checked against float64. It also measures the two ceilings the cost
model of ``elasticlab.gns.form_choice.use_gram`` uses (GEMM rate per dtype, copy bandwidth) and prints them,
and the L2 read bandwidth (:func:`l2_read_rate`, also with ``--sweep-only``), against which the ``TB/s`` lines
read.

    python benchmarks/bench_seq_linear_cuda.py [--iters 10]
Last line: ``RESULT {json}``.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from elasticlab.gns import form_choice, kernels, triton_launch, triton_outer, triton_tune

if triton_outer.HAS_TRITON:
    import triton
    import triton.language as tl
if triton_outer.HAS_TMA:
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _wgrad_gemm_kernel(a_desc, d_desc, grad_ptr, BT, Din, Dout,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Σ_t d_tᵀ a_t over all B·T rows, one (BM × BN) tile a program: the weight-gradient GEMM alone,
        in Triton, with TMA loads (the fused kernel's loop without its per-example epilogue)."""
        pid = tl.program_id(0)
        num_n = tl.cdiv(Din, BN)
        m0 = (pid // num_n) * BM
        n0 = (pid % num_n) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, BT, BK):
            acc = tl.dot(d_desc.load([k, m0]).T, a_desc.load([k, n0]), acc)
        rows, cols = m0 + tl.arange(0, BM), n0 + tl.arange(0, BN)
        tl.store(grad_ptr + rows[:, None] * Din + cols[None, :], acc,
                 mask=(rows[:, None] < Dout) & (cols[None, :] < Din))


if triton_outer.HAS_TRITON:
    @triton.jit
    def _l2_read_kernel(x_ptr, out_ptr, NBLK, PASSES: tl.constexpr, BLOCK: tl.constexpr):
        """Reads x (NBLK blocks of BLOCK values) PASSES times, program p taking blocks p, p + programs, …,
        past L1 (``.cg``), and stores its float32 sums (one BLOCK row a program): after a first pass the
        buffer sits in L2, so the time is L2's to give."""
        pid = tl.program_id(0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(pid, NBLK * PASSES, tl.num_programs(0)):
            x = tl.load(x_ptr + (i % NBLK) * BLOCK + tl.arange(0, BLOCK), cache_modifier=".cg")
            acc += x.to(tl.float32)
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def l2_read(x: torch.Tensor, passes: int, programs: int, block: int = 2048) -> torch.Tensor:
    """(programs, block) float32 sums of :func:`_l2_read_kernel` over ``x`` (a multiple of ``block``
    values)."""
    out = torch.empty(programs, block, device=x.device, dtype=torch.float32)
    _l2_read_kernel[(programs,)](x, out, x.numel() // block, PASSES=passes, BLOCK=block, num_warps=4)
    return out


def l2_read_rate(iters: int, mb: int = 16, passes: int = 64) -> float:
    """TB/s of L2 read by :func:`l2_read`: a ``mb`` MB bfloat16 buffer (well within an H100's or H200's 50 MB
    of L2) read ``passes`` times by four programs an SM (1 GB a launch: its start is lost in the time). The
    ceiling to set the sweep's ``TB/s`` lines against (TMA loads into shared memory may draw somewhat more or
    less than these plain loads)."""
    x = torch.randn(mb << 19, device="cuda").to(torch.bfloat16)
    programs = 4 * triton_launch.sm_count(x.device)
    return passes * x.numel() * 2 / timed(lambda: l2_read(x, passes, programs), iters) / 1e9


def _num(v) -> str:
    """A measured value to one decimal, or an error's text as it is."""
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def _l2_ceiling(iters: int) -> float | str:
    """:func:`l2_read_rate`, or its error as text: a ceiling that fails to measure must not stop the sweep."""
    try:
        return l2_read_rate(iters)
    except Exception as e:                                       # e.g. a Triton that rejects the kernel
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def triton_wgrad(a: torch.Tensor, d: torch.Tensor, tile: tuple) -> torch.Tensor:
    """The (Dout, Din) float32 weight gradient by :func:`_wgrad_gemm_kernel` in ``tile`` (BM, BN, BK, warps,
    stages): Triton's own GEMM at the fused kernel's tile, against which the fused kernel's per-example work
    is what remains (the sweep's ``triton-gemm`` line)."""
    bm, bn, bk, warps, stages = tile[:5]
    Din, Dout = a.shape[-1], d.shape[-1]
    a2, d2 = a.reshape(-1, Din), d.reshape(-1, Dout)
    grad = torch.empty(Dout, Din, device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(Dout, bm) * triton.cdiv(Din, bn),)
    _wgrad_gemm_kernel[grid](TensorDescriptor(a2, list(a2.shape), list(a2.stride()), [bk, bn]),
                             TensorDescriptor(d2, list(d2.shape), list(d2.stride()), [bk, bm]),
                             grad, a2.shape[0], Din, Dout, BM=bm, BN=bn, BK=bk, num_warps=warps,
                             num_stages=stages)
    return grad

SHAPES = {  # name: (B, T, Din, Dout, dtype)
    "G1.qkv": (8, 1024, 768, 2304), "G1.proj": (8, 1024, 768, 768), "G1.fc": (8, 1024, 768, 3072),
    "G1.fc2": (8, 1024, 3072, 768), "G1.head": (8, 1024, 768, 50304),
    "G3.up": (64, 512, 1024, 4096), "G3.down": (64, 512, 4096, 1024),
    "W2.up": (32, 128, 256, 1024), "W3.up": (8, 512, 256, 1024),
}
RUNS = [(n, torch.bfloat16) for n in SHAPES] + [(n, torch.float32) for n in SHAPES if not n.startswith("G3")]


def timed(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        torch.cuda.synchronize()
        out.append(t0.elapsed_time(t1))
    return statistics.median(out)


def _gemm_rate(dt: torch.dtype, iters: int) -> float:
    a, b = torch.randn(8192, 8192, device="cuda", dtype=dt), torch.randn(8192, 8192, device="cuda", dtype=dt)
    return 2 * 8192 ** 3 / timed(lambda: a @ b, max(3, iters // 2)) / 1e9


def ceilings(iters: int) -> dict:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")          # 256 MB
    y = torch.empty_like(x)
    out = {"copy_TBps": 2 * x.numel() / timed(lambda: y.copy_(x), iters) / 1e9}
    if triton_outer.HAS_TRITON:
        out["l2_read_TBps"] = _l2_ceiling(iters)
    for dt in (torch.bfloat16, torch.float32):
        out[f"gemm_TFLOPs_{str(dt).split('.')[-1]}"] = _gemm_rate(dt, iters)
    return out


def methods(a: torch.Tensor, d: torch.Tensor, name: str = "") -> dict:
    """{method: call returning (norms, ...)} on a (B, T, Din) and d (B, T, Dout): the operators of ``_C``
    (where it serves the device), ``bmm`` (cublas's batched GEMM alone, its fold being the rest of cublas's
    time) and the Triton kernels in both loops (float32: exact products, "ieee", as the GEMM here)."""
    Din, Dout = a.shape[2], d.shape[2]
    a2, d2, dT = a.reshape(-1, Din), d.reshape(-1, Dout), d.transpose(1, 2)
    meth = {}
    if kernels.compiled("seq_linear_outer_norms", a):
        meth["cublas"] = lambda: torch.ops.elasticlab.seq_linear_outer_norms(a, d, True)
    meth["bmm"] = lambda: (torch.bmm(dT, a),)
    if kernels.compiled("seq_linear_gram_norms", a) and name != "G1.head":  # T×T Grams beside a 50304-wide
        meth["gram"] = lambda: (torch.ops.elasticlab.seq_linear_gram_norms(a, d), d2.t() @ a2)  # GEMM: slow
    if triton_outer.HAS_TRITON:
        cfg = triton_outer._config(Din, Dout, a.dtype)[:5]
        meth["triton"] = lambda: triton_outer.outer_norms(a, d, True, cfg + (False,))
        meth["flat"] = lambda: triton_outer.outer_norms(a, d, True, cfg + (True,))
        if triton_tune.TMA and triton_outer.tma_ok(a, d):          # ELASTICLAB_TRITON_TMA=0: left out
            meth["tma"] = lambda: triton_outer.outer_norms(a, d, True, cfg + (False, True))
            meth["tma-flat"] = lambda: triton_outer.outer_norms(a, d, True, cfg + (True, True))
        if triton_tune.GHOST:                                      # ELASTICLAB_TRITON_GHOST=0: left out
            meth["ghost"] = lambda: triton_tune.ghost(a, d, True)  # fused Gram kernel + the weight GEMM
        # what the layers run: the form the tuner keeps for this shape (timed at its first call)
        meth["tuned"] = lambda: triton_tune.outer_norms(a, d, True)
    return meth


def kept_form(a: torch.Tensor, d: torch.Tensor) -> str:
    """The form :mod:`elasticlab.gns.triton_tune` kept for these operands' shape and dtype ("-" if none)."""
    for key, name in triton_tune.chosen().items():
        if key[:5] == (*a.shape, d.shape[2], a.dtype) and key[6]:
            return name
    return "-"


def rel_errors(meth: dict, a: torch.Tensor, d: torch.Tensor) -> dict:
    """Each method's largest relative error on the first two examples' norms against float64."""
    want = kernels.seq_linear_outer_norms_ref(a[:2].double(), d[:2].double())[0]
    return {m: float(((f()[0][:2].double() - want).abs() / want).max())
            for m, f in meth.items() if m != "bmm"}


def run_layer(name: str, dt: torch.dtype, iters: int) -> dict:
    """Ratios of each method to the weight-gradient GEMM for one layer shape, and their errors vs float64."""
    B, T, Din, Dout = SHAPES[name]
    a = torch.randn(B, T, Din, device="cuda").to(dt)
    d = (torch.randn(B, T, Dout, device="cuda") / T ** 0.5).to(dt)
    a2, d2 = a.view(-1, Din), d.view(-1, Dout)
    meth = methods(a, d, name)
    errs = rel_errors(meth, a, d)
    base = timed(lambda: d2.t() @ a2, iters)
    return {"wgrad_ms": base, "ratio": {m: timed(f, iters) / base for m, f in meth.items()}, "rel_err": errs,
            "scratch_mb": {m: _scratch_mb(f) for m, f in meth.items()}, "tuned": kept_form(a, d)}


def _scratch_mb(fn) -> float:
    """Peak memory one call allocates beyond what was live before it (its outputs included), in MB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


# Pointer loads: the default 128×128 tile at 3 and 4 stages. TMA loads, which won every large-layer sweep
# since session 10 (H100, H200): those, narrower and wider tiles (the tuner's WIDE first among them), a
# K step of 128 (half the loop turns a T = 512 example), and a 256-row tile.
_POINTER_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4)]
_TMA_TILES = _POINTER_TILES + [(128, 64, 64, 4, 4), (64, 128, 64, 4, 4), triton_tune.WIDE,
                               (128, 256, 64, 8, 4), (128, 256, 32, 8, 5), (256, 128, 64, 8, 3),
                               (128, 128, 128, 8, 3)]
# (BM, BN, BK, warps, stages, loop, tma[, swap]): each tile in both loops; the default and the wide tile in
# the TMA flat loop on the mirrored shape too (swap: G3.down then runs as G3.up's geometry); the overlapped
# loop (triton_outer.OVERLAP) in the default tile at 4 and 3 stages, and in 128×64 with 8 warps (which holds
# its three tiles without spilling), both orientations
SWEEP = {"layers": ["G3.up", "G3.down", "G1.head"],
         "configs": [t + (f, False) for t in _POINTER_TILES for f in (False, True)]
         + ([t + (f, True) for t in _TMA_TILES for f in (False, True)]
            + [t + (True, True, True) for t in ((128, 128, 64, 8, 4), triton_tune.WIDE)]
            + [t + (triton_outer.OVERLAP, True) + s for t in ((128, 128, 64, 8, 4), (128, 128, 64, 8, 3),
                                                                (128, 64, 64, 8, 4)) for s in ((), (True,))]
            if triton_tune.TMA else [])}


WGRAD_MS: dict[str, float] = {}          # layer -> the weight-gradient GEMM's ms, as the last sweep timed it


def _sweep_layer(name: str, iters: int, configs, form) -> dict:
    """{str(config): time of ``form(a, d, config)`` over the weight-gradient GEMM's, or the error} on one
    layer's bfloat16 operands (the GEMM's own time: :data:`WGRAD_MS`)."""
    B, T, Din, Dout = SHAPES[name]
    a = torch.randn(B, T, Din, device="cuda").to(torch.bfloat16)
    d = (torch.randn(B, T, Dout, device="cuda") / T ** 0.5).to(torch.bfloat16)
    base = WGRAD_MS[name] = timed(lambda: d.view(-1, Dout).t() @ a.view(-1, Din), iters)
    row = {}
    for cfg in configs:
        try:
            row[str(cfg)] = timed(lambda cfg=cfg: form(a, d, True, cfg), iters) / base
        except Exception as e:                                      # e.g. out of shared memory
            row[str(cfg)] = f"error: {type(e).__name__}"
    return row


def _cells(pairs, label="{}x{}x{}/{}/{}") -> str:
    """A sweep line's cells, "config ratio" for each (config, ratio or error) pair: the config's leading
    numbers as ``label`` formats them (an outer tile: BMxBNxBK/warps/stages), or ``label(config)`` when it is
    a function (a variant's name)."""
    return "  ".join((label(c) if callable(label) else label.format(*c)) + " "
                     + (f"{v:.2f}x" if isinstance(v, float) else v) for c, v in pairs)


def operand_bytes(name: str, tile: tuple) -> int:
    """Bytes a launch in ``tile`` (BM, BN, …) of the fused kernel, or of the plain Triton GEMM, loads into
    shared memory on bfloat16 layer ``name``: each of its ⌈Dout/BM⌉·⌈Din/BN⌉ programs loads BM values of δ and
    BN of a for each of the B·T rows. Every program reads its operands from L2, so over a time this is the
    L2 bandwidth the launch drew (the ``TB/s`` lines)."""
    B, T, Din, Dout = SHAPES[name]
    bm, bn = tile[:2]
    return -(-Dout // bm) * -(-Din // bn) * B * T * (bm + bn) * 2


def _rates(name: str, pairs, wgrad_ms: float) -> str:
    """A ``TB/s`` line's cells: for each (config, ratio over the GEMM) pair, the operand bytes it loaded
    (:func:`operand_bytes`) over its time (ratio × ``wgrad_ms``, the GEMM's time its ratio was taken
    against), in TB/s."""
    return _cells((c, f"{operand_bytes(name, c) / (v * wgrad_ms * 1e9):.1f}" if isinstance(v, float) else v)
                  for c, v in pairs)


def sweep_triton(iters: int, layers=None) -> dict:
    """The fused kernel's time over the weight-gradient GEMM's for a few tile configurations (bf16), on
    ``layers`` (default: :data:`SWEEP`'s); with TMA, also Triton's plain weight-gradient GEMM in each TMA
    tile (``gemm`` entries; line ``triton-gemm``): what of the fused kernel's excess is Triton's GEMM and
    what its per-example work."""
    out = {}
    gemm_tiles = sorted({c[:5] for c in SWEEP["configs"] if c[6]}) if triton_outer.HAS_TMA else []
    for name in layers or SWEEP["layers"]:
        row = out[name] = _sweep_layer(name, iters, SWEEP["configs"], triton_outer.outer_norms)
        wgrad_ms = WGRAD_MS[name]                           # (the gemm sweep below times the GEMM again)
        gemm = _sweep_layer(name, iters, gemm_tiles, lambda a, d, _, tile: (triton_wgrad(a, d, tile),))
        row.update({f"gemm {k}": v for k, v in gemm.items()})
        if gemm:
            print(f"sweep {name:8s} {'triton-gemm':13s} " + _cells(zip(gemm_tiles, gemm.values())))
        ov = triton_outer.OVERLAP
        for tma, flat, swap in ((False, False, False), (False, True, False), (True, False, False),
                                (True, True, False), (True, True, True), (True, ov, False), (True, ov, True)):
            # one line per variant: BMxBNxBK/warps/stages ratio
            loop = ("tma-" if tma else "") + triton_outer.LOOPS[flat] + ("-swap" if swap else "")
            print(f"sweep {name:8s} {loop:13s} " + _cells(
                (c, v) for c, v in zip(SWEEP["configs"], row.values())     # (gemm entries come last)
                if (c[5], c[6], len(c) > 7 and c[7]) == (flat, tma, swap)))
        # the L2 bandwidth each TMA flat launch and each plain GEMM drew (their loads over their time)
        flat_tma = [(c, v) for c, v in zip(SWEEP["configs"], row.values()) if c[5] is True and c[6]
                    and not (len(c) > 7 and c[7])]
        if flat_tma:
            print(f"sweep {name:8s} {'tma-flat TB/s':13s} " + _rates(name, flat_tma, wgrad_ms))
        if gemm:
            print(f"sweep {name:8s} {'gemm TB/s':13s} "
                  + _rates(name, zip(gemm_tiles, gemm.values()), WGRAD_MS[name]))
        row.update(sweep_bias(name, iters))
        row.update(sweep_split(name, iters))
    return out


# The TMA flat loop in the default and the wide tile: the variants the tuner kept on G3 and G1.head (H200)
SPLIT_CONFIGS = [(128, 128, 64, 8, 4, True, True), triton_tune.WIDE + (True, True)]


def sweep_split(name: str, iters: int) -> dict:
    """{"per-sm P config": time over the weight-gradient GEMM's} of :data:`SPLIT_CONFIGS` with the examples
    split for P = 1 and 2 programs per SM (:data:`elasticlab.gns.triton_launch.PROGRAMS_PER_SM`), where the
    two give different splits; printed as lines ``per-sm-1`` and ``per-sm-2``, each cell with its split."""
    B, _, Din, Dout = SHAPES[name]
    dev, before, out = torch.device("cuda"), triton_launch.PROGRAMS_PER_SM, {}
    configs = [c for c in SPLIT_CONFIGS if triton_tune.TMA]

    def split(c, p):
        return triton_launch.splits(B, -(-Dout // c[0]) * -(-Din // c[1]), dev, p)
    configs = [c for c in configs if split(c, 1) != split(c, 2)]
    if not configs:
        return out
    for p in (1, 2):
        triton_launch.PROGRAMS_PER_SM = p
        try:
            row = _sweep_layer(name, iters, configs, triton_outer.outer_norms)
        finally:
            triton_launch.PROGRAMS_PER_SM = before
        out.update({f"per-sm {p} {k}": v for k, v in row.items()})
        print(f"sweep {name:8s} {f'per-sm-{p}':13s} " + _cells(
            zip(configs, row.values()), lambda c, p=p: f"{triton_tune.variant_name(c)}(split {split(c, p)})"))
    return out


# The default 16-bit tile in both loops, pointer and TMA loads: with the per-example bias gradients too
# (a layer with a bias), summed apart (``d.sum(1)`` after the kernel) or in the kernel (FUSE_BIAS)
BIAS_CONFIGS = [(128, 128, 64, 8, 4, flat, tma) for tma in (False, True) for flat in (False, True)]


def sweep_bias(name: str, iters: int) -> dict:
    """{"bias apart|fused config": time over the weight-gradient GEMM's} of :data:`BIAS_CONFIGS` returning
    the bias gradients too, summed apart and in the kernel (:data:`elasticlab.gns.triton_outer.FUSE_BIAS`);
    printed as lines ``bias-apart`` and ``bias-fused``."""
    out, before = {}, triton_outer.FUSE_BIAS
    configs = BIAS_CONFIGS if triton_tune.TMA else [c for c in BIAS_CONFIGS if not c[6]]
    for fused in (False, True):
        triton_outer.FUSE_BIAS = fused
        try:
            row = _sweep_layer(name, iters, configs,
                               lambda a, d, g, c: triton_outer.outer_norms(a, d, g, c, bias=True))
        finally:
            triton_outer.FUSE_BIAS = before
        kind = "fused" if fused else "apart"
        out.update({f"bias {kind} {k}": v for k, v in row.items()})
        print(f"sweep {name:8s} {'bias-' + kind:13s} "
              + _cells(zip(configs, row.values()), triton_tune.variant_name))
    return out


# The fused Gram kernel's blocks (BT, BK, warps, stages), the form with the weight-gradient GEMM beside it,
# on the layers where its multiply-adds are fewest against the outer form's (G3: 0.39): its own config
# first, then ghost-k128's (both timed by triton_tune), a shallower pipeline, a shorter K step, 64-row blocks.
GHOST_SWEEP = {"layers": ["G3.up", "G3.down"],
               "configs": [(128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 8, 3), (128, 32, 8, 5),
                           (64, 64, 4, 4), (64, 128, 4, 3)]}


def sweep_ghost(iters: int) -> dict:
    """The fused Gram form's time over the weight-gradient GEMM's, each of :data:`GHOST_SWEEP`'s configs."""
    out = {}
    for name in GHOST_SWEEP["layers"]:
        row = out[name] = _sweep_layer(name, iters, GHOST_SWEEP["configs"], triton_tune.ghost)
        torch.cuda.empty_cache()
        print(f"ghost {name:8s} " + _cells(zip(GHOST_SWEEP["configs"], row.values()), "{}x{}/{}/{}"))
    return out


# The cuBLAS form's chunk of examples (form_choice.scratch_cap): L2-sized chunks (an H100 has 50 MB of L2) may
# let the fold read the products the batched GEMM just wrote from L2 instead of HBM, at more launches a layer.
# Layers whose product fits a few times in L2: G3's in bfloat16 (8 MB an example), G1's in float32 (7-9 MB).
CHUNKS = {"layers": [("G3.up", torch.bfloat16), ("G3.down", torch.bfloat16), ("G1.qkv", torch.float32),
                     ("G1.fc", torch.float32)],
          "caps_mb": [8, 16, 32, 64, 256]}


def _chunk_layer(name: str, dt: torch.dtype, iters: int) -> dict:
    B, T, Din, Dout = SHAPES[name]
    a = torch.randn(B, T, Din, device="cuda").to(dt)
    d = (torch.randn(B, T, Dout, device="cuda") / T ** 0.5).to(dt)
    base = timed(lambda: d.view(-1, Dout).t() @ a.view(-1, Din), iters)
    row = {}
    for mb in CHUNKS["caps_mb"]:
        with form_choice.scratch_cap(mb << 20):
            def call():
                return torch.ops.elasticlab.seq_linear_outer_norms(a, d, True)
            row[mb] = {"ratio": timed(call, iters) / base, "scratch_mb": _scratch_mb(call)}
    return row


def sweep_chunks(iters: int) -> dict:
    """The cuBLAS form's time over the weight-gradient GEMM's for each chunk budget of :data:`CHUNKS`, and the
    peak scratch (MB) of one call."""
    out = {}
    for name, dt in CHUNKS["layers"]:
        row = out[f"{name}:{str(dt).split('.')[-1]}"] = _chunk_layer(name, dt, iters)
        torch.cuda.empty_cache()
        print(f"chunks {name:8s} {str(dt).split('.')[-1]:9s} " + "  ".join(
            f"{mb}MB {v['ratio']:.2f}x ({v['scratch_mb']:.0f} MB)" for mb, v in row.items()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep-only", metavar="LAYERS", nargs="?", const=",".join(SWEEP["layers"]),
                    help="only the Triton tile sweep, on these layers (comma-separated; default: "
                    + ",".join(SWEEP["layers"]) + ")")
    args = ap.parse_args(argv)
    if args.sweep_only is not None:
        unknown = [n for n in args.sweep_only.split(",") if n not in SHAPES]
        if unknown:
            ap.error(f"--sweep-only: unknown layer {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if args.sweep_only is not None:
        if not triton_outer.HAS_TRITON:
            raise SystemExit("--sweep-only needs Triton")
        torch.manual_seed(0)
        l2 = _l2_ceiling(args.iters)
        print(f"ceilings: l2_read_TBps {_num(l2)}")                 # what the TB/s lines are set against
        sweep = sweep_triton(args.iters, args.sweep_only.split(","))
        print("RESULT " + json.dumps({"ceilings": {"l2_read_TBps": l2}, "triton_sweep": sweep}))
        return 0
    torch.manual_seed(0)
    ceil = ceilings(args.iters)
    print("ceilings: " + ", ".join(f"{k} {_num(v)}" for k, v in ceil.items()))
    rows = {}
    cols = ("triton", "flat", "tma", "tma-flat", "ghost", "tuned", "cublas", "bmm", "gram")
    print(f"{'layer':10s} {'dtype':9s} {'wgrad ms':>9s} " + " ".join(f"{c:>8s}" for c in cols) + "   "
          f"rel.err vs fp64 ({' / '.join(c for c in cols if c != 'bmm')})")
    for name, dt in RUNS:
        res = rows[f"{name}:{str(dt).split('.')[-1]}"] = run_layer(name, dt, args.iters)
        torch.cuda.empty_cache()
        r, e = res["ratio"], res["rel_err"]
        print(f"{name:10s} {str(dt).split('.')[-1]:9s} {res['wgrad_ms']:9.3f} "
              + " ".join(f"{r[m]:7.2f}x" if m in r else f"{'-':>8s}" for m in cols)
              + "   " + " / ".join(f"{e[m]:.1e}" if m in e else "-" for m in cols if m != "bmm")
              + "   scratch MB " + " / ".join(f"{res['scratch_mb'][m]:.0f}" if m in r else "-" for m in cols)
              + f"   tuned: {res['tuned']}")
    # the chunk sweep first: no compiling, where the Gram and Triton sweeps compile a kernel per configuration
    has_op = kernels.compiled("seq_linear_outer_norms", torch.empty(0, device="cuda"))
    chunks = sweep_chunks(args.iters) if has_op else {}
    ghost = sweep_ghost(args.iters) if triton_outer.HAS_TRITON and triton_tune.GHOST else {}
    sweep = sweep_triton(args.iters) if triton_outer.HAS_TRITON else {}
    print("RESULT " + json.dumps({"ceilings": ceil, "layers": rows, "triton_sweep": sweep, "chunks": chunks,
                                  "ghost_sweep": ghost}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
