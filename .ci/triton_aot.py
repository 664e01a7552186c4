"""Compile the Triton kernels ahead of time for an H100 (sm_90), without a GPU: Triton's own compiler and
ptxas, for every tile the wrappers choose, each dtype and precision, both loops, with and without the
gradient, and the tile sweeps of benchmarks/bench_seq_linear_cuda.py. Fails on a kernel that does not compile,
that needs more shared memory than an sm_90 block may have, or, among those the layers launch by default
(16-bit, row-major operands, the wrappers' and the tuner's configs: :func:`on_default_path`), that spills
registers (the tuner's wide tile and overlapped loop, which spill by design: more than
:data:`CANDIDATE_SPILL_BYTES`);
prints each kernel's shared memory, registers and spills (ptxas's log). Run by .ci/run in
.venv-cuda (its torch ships Triton):

    .venv-cuda/bin/python .ci/triton_aot.py [--jobs 2] [--digest FILE] [--kernels outer-tma,ghost]
        [--default-path]

``--default-path``: only the kernels on the default path and the tuner's candidates (what a GPU run compiles;
.ci/triton_gpu_version.sh checks them with the GPU machine's older Triton).

``--digest FILE`` also writes each kernel's SASS digest (JSON, label to SHA-256 of the disassembly without
the kernel's name): two trees whose digests are equal compile to the same machine code, which is how a
refactor of a kernel's source is checked without a GPU to time it. Triton compiles with line information by
default, and a @triton.jit helper's inlined scope adds debug labels that can reorder a few instructions; with
``TRITON_DISABLE_LINE_INFO=1`` the digests compare the programs alone.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import itertools
import json
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

SM90_SHARED = 232448          # bytes of shared memory one block may opt into on sm_90 (227 KiB)
ROW_MAJOR = ("sa_i", "sd_o")      # a sequence kernel's unit inner strides, as row-major operands launch it
# a contiguous NCHW 3×3 convolution with stride 1, padding 1 (most of ResNet's): Triton specialises each 1
CONV_3X3_S1 = ("sx_w", "sd_w", "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w")
UNALIGNED = ("NPAIRS", "P0")      # integers seldom divisible by 16 in a real launch (the Gram kernel's pairs)
DTYPES = {"bf16": "tf32", "fp16": "tf32", "fp32": "ieee", "fp32/tf32": "tf32"}   # pointer type: precision


KERNELS = ("outer", "outer-tma", "conv", "ghost")        # the names of _kernels(), for --kernels


def _kernels():
    from elasticlab.gns import triton_conv, triton_gram, triton_outer
    return dict(zip(KERNELS, (triton_outer._outer_norms_kernel, triton_outer._outer_norms_tma_kernel,
                              triton_conv._conv_outer_norms_kernel, triton_gram._ghost_norms_kernel)))


def cases() -> list[tuple]:
    """(kernel, dtype, meta, num_warps, num_stages, ints specialised to 1) for every variant checked."""
    import bench_seq_linear_cuda as bench

    from elasticlab.gns import triton_conv, triton_tune
    out = []
    import torch
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                   "fp32/tf32": torch.float32}
    # (tile, dtype) as the wrappers choose them: the tile and its pipeline depth depend on the dtype
    outer_tiles = sorted({(tile, dt) for dt in DTYPES for tile in _outer_tiles(torch_dtype[dt])})
    # both forms (pointer loads; TMA descriptors), both loops, with and without the gradient. The pointer
    # kernel as the layers launch it: row-major operands (triton_outer.preferred), whose unit inner strides
    # Triton specialises to the constant 1; with any strides too (a direct call), where addresses take more
    # registers
    for kernel, ((bm, bn, bk, w, s), dt), flat, grad in itertools.product(
            ("outer", "outer-tma"), outer_tiles, (False, True), (False, True)):
        meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=grad, PRECISION=DTYPES[dt], FLAT=flat)
        out.append((kernel, dt, meta, w, s, ()))
        if kernel == "outer":
            out.append((kernel, dt, meta, w, s, ROW_MAJOR))
    # the tuner's wide tile (TMA loads, 16-bit layers), both loops, with and without the gradient
    for dt, flat, grad in itertools.product(("bf16", "fp16"), (False, True), (False, True)):
        bm, bn, bk, w, s = triton_tune.WIDE
        meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=grad, PRECISION="tf32", FLAT=flat)
        out.append(("outer-tma", dt, meta, w, s, ()))
    # the tuner's deeper K step (TMA loads, 16-bit layers, the flat loop): with and without the gradient, both
    # gradient layouts (a mirrored launch stores it transposed), without and with the bias sums
    # (triton_outer.fuses_bias takes its 128×128 tile: 1 from δ's tiles, 2 a mirrored launch's, from a's)
    for dt, grad, grad_t in itertools.product(("bf16", "fp16"), (False, True), (False, True)):
        bm, bn, bk, w, s = triton_tune.DEEP
        for bias in ((0, 2 if grad_t else 1) if grad else (0,)):
            meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=grad, PRECISION="tf32", FLAT=True)
            meta.update({"GRAD_T": True} if grad_t else {}, **({"BIAS": bias} if bias else {}))
            out.append(("outer-tma", dt, meta, w, s, ()))        # (as the sweep's, where they coincide)
    # the overlapped flat loop (a second accumulator; TMA loads) in the default 16-bit tiles, both gradient
    # layouts, with and without the gradient
    for h, grad_t, grad in itertools.product(("bf16", "fp16"), (False, True), (False, True)):
        for bm, bn, bk, w, s in sorted(_outer_tiles(torch_dtype[h])):
            meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=grad, PRECISION="tf32", FLAT=True, GRAD_T=grad_t,
                        OVERLAP=True)
            out.append(("outer-tma", h, meta, w, s, ()))
    # the tuner's mirrored launches (swap): the gradient tile stored transposed, 16-bit, the default tiles
    # and the wide one, both loops
    mirrored = [(t, h) for h in ("bf16", "fp16")
                for t in sorted(_outer_tiles(torch_dtype[h]) | {triton_tune.WIDE})]
    for (tile, dt), flat in itertools.product(mirrored, (False, True)):
        bm, bn, bk, w, s = tile
        meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=True, PRECISION="tf32", FLAT=flat, GRAD_T=True)
        out.append(("outer-tma", dt, meta, w, s, ()))
        if tile != triton_tune.WIDE:
            out.append(("outer", dt, meta, w, s, ROW_MAJOR))
    # the per-example bias sums fused in (triton_outer.FUSE_BIAS; BIAS 1: from δ's tiles, 2: a mirrored
    # launch's, from a's), where triton_outer.fuses_bias: 16-bit, the default tiles, both loops, both forms
    for h, bias, flat in itertools.product(("bf16", "fp16"), (1, 2), (False, True)):
        for bm, bn, bk, w, s in sorted(_outer_tiles(torch_dtype[h])):
            meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=True, PRECISION="tf32", FLAT=flat, GRAD_T=bias == 2,
                        BIAS=bias)
            out.append(("outer-tma", h, meta, w, s, ()))
            out.append(("outer", h, meta, w, s, ROW_MAJOR))
    for bm, bn, bk, w, s, flat, tma, *_ in bench.SWEEP["configs"]:          # a swap runs the same kernel
        meta = dict(BM=bm, BN=bn, BK=bk, WITH_GRAD=True, PRECISION="tf32", FLAT=flat)
        out.append(("outer-tma", "bf16", meta, w, s, ()) if tma else ("outer", "bf16", meta, w, s, ROW_MAJOR))
    # as launched on a contiguous layer with one split: SPLIT is specialised to 1 too
    meta = dict(BM=128, BN=128, BK=64, WITH_GRAD=True, PRECISION="tf32", FLAT=True)
    out.append(("outer", "bf16", meta, 8, 3, ROW_MAJOR + ("SPLIT",)))
    layers = ((3, 64), (512, 512))
    conv_tiles = {triton_conv._config(t, cin, cout) for t in (4, 16, 32, 1024) for cin, cout in layers}
    for (bm, bn, bk, w, s), dt in itertools.product(sorted(conv_tiles), DTYPES):
        meta = dict(KH=3, KW=3, BM=bm, BN=bn, BK=bk, WITH_GRAD=True, PRECISION=DTYPES[dt])
        out.append(("conv", dt, meta, w, s, ()))
        out.append(("conv", dt, meta, w, s, CONV_3X3_S1))
    for kh, kw in ((1, 1), (7, 7), (1, 5)):          # 1×1, ResNet's stem, a Conv1d (H = 1)
        meta = dict(KH=kh, KW=kw, BM=64, BN=64, BK=32, WITH_GRAD=False, PRECISION="tf32")
        ones = ("H", "Ho", "stride_h", "stride_w", "dil_h", "dil_w", "SPLIT") if kh == 1 else ()
        out.append(("conv", "bf16", meta, 4, 3, ones))
    # the fused Gram form: each config the tuner times (tuned_configs) for short and long sequences, each
    # dtype, the diagonal and the other pairs' launches, any strides and as launched on contiguous activations
    # (unit inner strides, specialised to 1)
    for dt, diag, ones in itertools.product(DTYPES, (True, False), ((), ROW_MAJOR)):
        for bt, bk, w, s in sorted(_ghost_configs(torch_dtype[dt])):
            out.append(("ghost", dt, dict(BT=bt, BK=bk, PRECISION=DTYPES[dt], DIAG=diag), w, s, ones))
    for (bt, bk, w, s), diag in itertools.product(bench.GHOST_SWEEP["configs"], (True, False)):
        out.append(("ghost", "bf16", dict(BT=bt, BK=bk, PRECISION="tf32", DIAG=diag), w, s, ROW_MAJOR))
    return list({repr(c): c for c in out}.values())            # each kernel once (the tuner's are swept too)


def _outer_tiles(dtype) -> set[tuple]:
    """The outer kernel's (BM, BN, BK, warps, stages) that its wrapper chooses for ``dtype``: narrow and wide
    layers on both sides."""
    from elasticlab.gns import triton_outer
    sides = itertools.product((64, 4096), repeat=2)
    return {triton_outer._config(din, dout, dtype)[:5] for din, dout in sides}


def _ghost_configs(dtype) -> set[tuple]:
    """The Gram kernel's (BT, BK, warps, stages) that the tuner times for ``dtype``: short and long
    sequences."""
    from elasticlab.gns import triton_gram
    return {c for T in (40, 512) for c in triton_gram.tuned_configs(T, dtype).values()}


def on_default_path(case: tuple) -> bool:
    """Whether the layers launch this kernel by default: the outer kernel (pointer loads on row-major
    operands, or TMA) or the Gram kernel, on 16-bit operands, in a tile or config that the wrappers or the
    tuner choose (sweep-only configs are not)."""
    import torch

    from elasticlab.gns import triton_tune
    name, dt, meta, warps, stages, ones = case
    if dt not in ("bf16", "fp16") or (name != "outer-tma" and not set(ROW_MAJOR) <= set(ones)) \
            or meta.get("BIAS"):                    # the bias sums fused in: off by default (FUSE_BIAS)
        return False
    half = torch.bfloat16 if dt == "bf16" else torch.float16
    if name in ("outer", "outer-tma"):
        tile = (meta["BM"], meta["BN"], meta["BK"], warps, stages)
        deep = name == "outer-tma" and tile == triton_tune.DEEP and meta["FLAT"]      # the tuner's K step
        return tile in _outer_tiles(half) or deep
    if name == "ghost":
        return (meta["BT"], meta["BK"], warps, stages) in _ghost_configs(half)
    return False


# Two of the tuner's candidates pass 255 registers a thread by design, and ptxas spills a little: the wide
# tile's two float32 tiles (about 170 B, Triton 3.8) and the overlapped loop's three (about 110-130 B with the
# 128×128 tile); and the bias sums' pointer-loaded tiles (16-68 B). Above this many bytes stored it
# is a regression (checked like a default tile's spill).
CANDIDATE_SPILL_BYTES = 256


def spilling_candidate(case: tuple) -> bool:
    """Whether ``case`` is one of the tuner's candidates that spill by design: 16-bit, TMA loads, the wide
    tile (:data:`elasticlab.gns.triton_tune.WIDE`) or the overlapped loop; or, off by default
    (``triton_outer.FUSE_BIAS``), a kernel summing the bias gradients (whose pointer-loaded tiles spill 16-68
    B)."""
    from elasticlab.gns import triton_tune
    name, dt, meta, warps, stages, _ = case
    tile = (meta.get("BM"), meta.get("BN"), meta.get("BK"), warps, stages)
    return (name.startswith("outer") and dt in ("bf16", "fp16") and bool(meta.get("BIAS"))
            or name == "outer-tma" and dt in ("bf16", "fp16")
            and (tile == triton_tune.WIDE or bool(meta.get("OVERLAP"))))


def candidate_spill_over(case: tuple, label: str) -> bool:
    """Whether ``case`` is a :func:`spilling_candidate` that spills more than :data:`CANDIDATE_SPILL_BYTES`
    stored."""
    m = re.search(r"SPILLS (\d+) B stored", label)
    return spilling_candidate(case) and m is not None and int(m.group(1)) > CANDIDATE_SPILL_BYTES


def _ptxas_report(log: str) -> str:
    """Registers a thread and spilled bytes from ptxas's verbose log (Triton prints it with
    ``knobs.nvidia.dump_ptxas_log``): ", 167 regs" or ", 167 regs, SPILLS 64 B stored 64 B loaded"."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out = f", {regs.group(1)} regs" if regs else ""
    if spill and (int(spill.group(1)) or int(spill.group(2))):
        out += f", SPILLS {spill.group(1)} B stored {spill.group(2)} B loaded"
    return out


def sass_digest(cubin: bytes) -> str:
    """SHA-256 of a kernel's SASS (``cuobjdump -sass``, the one Triton bundles), its name lines left out."""
    import subprocess

    from triton import knobs
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True,
                              check=True).stdout.decode()
    body = [ln.strip() for ln in sass.splitlines() if ln.strip().startswith("/*")]    # instructions only
    return hashlib.sha256("\n".join(body).encode()).hexdigest()


def compile_case(case: tuple, digest: bool = False) -> tuple[str, str, int | None, str]:
    """(label, error or "", shared bytes, SASS digest or ""; registers and spills in the label): one kernel
    compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    name, dt, meta, warps, stages, ones = case
    fn = _kernels()[name]
    ptr = "*" + dt.split("/")[0]
    sig, consts = {}, dict(meta)
    if name in ("outer", "outer-tma"):
        consts.setdefault("GRAD_T", False)              # the gradient stored as the layer's (Dout, Din)
        consts.setdefault("BIAS", 0)                    # no bias sums (a layer without bias, the hook rule)
    if name == "outer-tma":
        consts.setdefault("OVERLAP", False)             # the flat loop without the second accumulator
    for arg in fn.arg_names:
        if arg in consts or arg in ones:
            sig[arg] = "constexpr"
            consts.setdefault(arg, 1)
        elif arg.endswith("_desc"):                # [1, BK, BN] blocks of a, [1, BK, BM] of d
            inner = meta["BN"] if arg == "a_desc" else meta["BM"]
            sig[arg] = f"tensordesc<{dt.split('/')[0]}[1,{meta['BK']},{inner}]>"
        elif arg == "pairs_ptr":                   # the Gram kernel's block-pair table
            sig[arg] = "*i32"
        elif arg.endswith("_ptr"):
            sig[arg] = "*fp32" if arg in ("partial_ptr", "grad_ptr", "bias_ptr") else ptr
        else:
            sig[arg] = "i32"
    label = f"{name} {dt} " + " ".join(f"{k}={v}" for k, v in meta.items() if k != "PRECISION") \
        + f" warps={warps} stages={stages}" + (f" ones={','.join(ones)}" if ones else "")
    # as Triton specialises a launch on aligned operands (every workload shape here is a multiple of 16):
    # pointers and integers divisible by 16, which is what lets its pipeliner issue asynchronous copies, so
    # that the shared memory checked is the multi-stage buffers a real launch takes
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if (sig[arg] == "i32" and arg not in UNALIGNED) or sig[arg].startswith("*")}
    log = io.StringIO()
    try:
        triton.knobs.nvidia.dump_ptxas_log = True                  # ptxas -v's log, printed by Triton
    except AttributeError:                                      # an older Triton: no register report
        pass
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        opts = dict(num_warps=warps, num_stages=stages)
        with contextlib.redirect_stdout(log):
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    except Exception as e:                                     # a compile error: the GPU run would fail too
        return label, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}", None, ""
    shared = int(k.metadata.shared)
    label += _ptxas_report(log.getvalue())
    err = "" if shared <= SM90_SHARED else f"needs {shared} B of shared memory"
    return label, err, shared, sass_digest(k.asm["cubin"]) if digest else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--digest", metavar="FILE", help="write each kernel's SASS digest here (JSON)")
    ap.add_argument("--kernels", metavar="NAMES", help="only these kernels, comma-separated: "
                    "outer, outer-tma, conv, ghost (default: all)")
    ap.add_argument("--default-path", action="store_true",
                    help="only the kernels the layers launch by default and the tuner's candidates")
    args = ap.parse_args(argv)
    todo = cases()
    if args.default_path:
        todo = [c for c in todo if on_default_path(c) or spilling_candidate(c)]
    if args.kernels:
        names = args.kernels.split(",")
        unknown = sorted(set(names) - set(KERNELS))
        if unknown:
            ap.error(f"unknown kernel {', '.join(unknown)} (known: {', '.join(KERNELS)})")
        todo = [c for c in todo if c[0] in names]
    # a fresh cache: a kernel found in Triton's cache is not compiled again, and so has no ptxas log
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_aot_")
    bad = spills = by_design = 0
    default_spills, digests = [], {}
    with ProcessPoolExecutor(args.jobs) as pool:
        run = functools.partial(compile_case, digest=bool(args.digest))
        for case, (label, err, shared, sha) in zip(todo, pool.map(run, todo)):
            if sha:
                digests[label.split(", ")[0]] = sha          # the label before its registers
            bad += bool(err)
            spills += "SPILLS" in label
            by_design += "SPILLS" in label and spilling_candidate(case)
            if "SPILLS" in label and on_default_path(case) and not spilling_candidate(case) \
                    or candidate_spill_over(case, label):
                default_spills.append(label)
            print(("FAIL " if err else "ok   ") + label + (f": {err}" if err else f" (shared {shared} B)"),
                  flush=True)
    print(f"{len(todo) - bad} of {len(todo)} Triton kernels compile for sm_90; {spills} spill registers, "
          f"{by_design} of those the tuner's wide tile or overlapped loop or the bias sums "
          f"(at most {CANDIDATE_SPILL_BYTES} B allowed), "
          f"{len(default_spills)} over the rules (a tile the layers launch by default, 16-bit, row-major, "
          "or a tuner candidate over its bound)")
    for label in default_spills:         # a regression of a default tile: its registers reach local memory
        print(f"FAIL spills on the default path (a tuner candidate: over {CANDIDATE_SPILL_BYTES} B): {label}")
    if args.digest:
        with open(args.digest, "w") as f:
            json.dump(digests, f, indent=0, sort_keys=True)
    return 1 if bad or default_spills else 0


if __name__ == "__main__":
    raise SystemExit(main())
