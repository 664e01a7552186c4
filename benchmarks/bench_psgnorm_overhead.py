"""Host (Python) overhead of per-example gradient norms on small steps, where kernels are cheap.

Two stacks of 24 layers with tiny batches, so that a step is dominated by per-layer dispatch rather than
arithmetic: ``mlp24`` (24 × Linear(D, D) + tanh on (B, D) inputs: the product-of-norms path) and ``seq24`` (24
× LayerNorm → Linear → GELU on (B, T, D): LayerNorm's rule and the sequence Linear) and ``conv24`` (24 ×
Conv2d 3×3 → GroupNorm → ReLU on (B, C, 4, 4): G2's layer families). Methods, timed interleaved in the same
run: ``plain`` (forward + backward), ``psgn`` (``PerSampleGradNorms``, fused backward, ``sq_norms()`` read
each step), ``psgn-torchops`` (the same, but the fused layers' operators called through torch.ops' boxed entry
rather than ``_C``'s direct one: ``kernels.USE_DIRECT_CALLS = False``) and ``psgn-hooks`` (hooks only); and,
asked for, ``plain-compiled`` and ``psgn-compiled`` (the model under ``torch.compile``, ``--compile-backend``:
Inductor by default, plainly and with the fused norms, whose layers then hand their norms out of the compiled
backward as gradients, :mod:`elasticlab.gns.sink`). ``--conv-form outer|gram`` sends conv24's convolutions to
the C++ function's CUDA forms (the batched GEMM or the Gram form over the patches) on the CPU, so that their
host work is counted here. Each round times ``--steps`` steps of one method, by the CPU time of the calling
thread (``time.thread_time``: with one intra-op thread the forward, the backward and the kernels all run
there, and other processes on a shared machine barely move it; ``--clock wall`` for wall time); the minimum
over ``--rounds`` rounds of the mean step is reported (the median too, as ``*_med``), with the ratio to plain
and the extra microseconds per layer ((psgn − plain) / 24). Timings on a loaded machine move by ±20%, so each
workload also gets two deterministic counts per step and method: ATen operators dispatched
(``torch.profiler``, CPU; and those outside elasticlab's kernel operators, whose inner ATen calls are the
device's own) and Python function calls (``cProfile``), under ``counts``. ``--profile``: cProfile of ``psgn``
steps, the top functions by own time. Last line: ``RESULT {json}``.

    python benchmarks/bench_psgnorm_overhead.py [--rounds 15] [--steps 30] [--threads 1]
        [--clock thread|wall] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from elasticlab.gns import PerSampleGradNorms, kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_psgnorm import COMPILED, compiled  # noqa: E402  (the compiled methods: one list, one way)

LAYERS = 24
CONV_FORMS = {"auto": None, "outer": 0, "gram": 1, "grouped": 2}     # --conv-form: the C++ function's forms


class MLP(nn.Module):
    def __init__(self, D: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


class SeqStack(nn.Module):
    def __init__(self, D: int):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(LAYERS))
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))

    def forward(self, x):
        for ln, lin in zip(self.norms, self.lins):
            x = torch.nn.functional.gelu(lin(ln(x)))
        return x


class ConvStack(nn.Module):
    """G2's layer families (ResNet-18 with GroupNorm): Conv2d 3×3 → GroupNorm → ReLU, 24 times."""

    def __init__(self, C: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(C, C, 3, padding=1, bias=False) for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.GroupNorm(2, C) for _ in range(LAYERS))

    def forward(self, x):
        for conv, gn in zip(self.convs, self.norms):
            x = torch.relu(gn(conv(x)))
        return x


def workload(name: str):
    torch.manual_seed(0)
    if name == "mlp24":
        return MLP(32), torch.randn(4, 32)
    if name == "seq24":
        return SeqStack(32), torch.randn(2, 8, 32)
    if name == "conv24":
        return ConvStack(8), torch.randn(2, 8, 4, 4)
    raise ValueError(f"unknown workload {name!r}")


# The model under torch.compile (``--compile-backend``), plainly and with the fused norms: made once per
# workload (a context entered anew gives the layers new forwards, which Dynamo would recompile each round).
COMPILE_BACKEND = "inductor"


def make_step(method: str, model: nn.Module, x: torch.Tensor, run=None):
    """A closure running one step; ``.close()`` leaves the context of the psgn methods. ``run``: what runs
    the forward (the model, or its compiled form)."""
    if method in COMPILED:
        return make_step(COMPILED[method], model, x, run=compiled(model, COMPILE_BACKEND))
    run = model if run is None else run
    if method == "plain":
        def step():
            model.zero_grad(set_to_none=True)
            run(x).pow(2).mean().backward()
        step.close = lambda: None
        return step
    if method not in ("psgn", "psgn-torchops", "psgn-hooks"):
        raise ValueError(f"unknown method {method!r}")
    ctx = PerSampleGradNorms(model, fused=method != "psgn-hooks").__enter__()
    direct = method != "psgn-torchops"

    def step():
        before, kernels.USE_DIRECT_CALLS = kernels.USE_DIRECT_CALLS, direct
        try:
            model.zero_grad(set_to_none=True)
            run(x).pow(2).mean().backward()
            return ctx.sq_norms()
        finally:
            kernels.USE_DIRECT_CALLS = before
    step.close = lambda: ctx.__exit__(None, None, None)
    return step


def time_workload(name: str, methods, rounds: int, steps: int, clock=time.thread_time) -> dict:
    model, x = workload(name)
    per: dict[str, list[float]] = {m: [] for m in methods}
    # each compiled method keeps its own copy of the model, compiled once, and its context for all rounds
    kept = {m: make_step(m, workload(name)[0], x) for m in methods if m in COMPILED}
    try:
        for r in range(rounds + 1):             # round 0 is the warm-up
            for m in methods:                   # a psgn method's context is entered for its own round only
                step = kept.get(m) or make_step(m, model, x)
                try:
                    for _ in range(5):
                        step()
                    t0 = clock()
                    for _ in range(steps):
                        step()
                    dt = (clock() - t0) / steps
                finally:
                    if m not in kept:
                        step.close()
                if r:
                    per[m].append(dt)
    finally:
        for step in kept.values():
            step.close()
    best = {m: min(v) for m, v in per.items()}
    med = {m: statistics.median(v) for m, v in per.items()}
    out = {"plain_us": round(best["plain"] * 1e6, 1), "plain_us_med": round(med["plain"] * 1e6, 1)}
    for m in methods:
        if m == "plain":
            continue
        out[m] = {"us": round(best[m] * 1e6, 1), "ratio": round(best[m] / best["plain"], 3),
                  "extra_us_per_layer": round((best[m] - best["plain"]) * 1e6 / LAYERS, 2),
                  "ratio_med": round(med[m] / med["plain"], 3)}
        if m == "psgn-compiled" and "plain-compiled" in best:        # against the compiled plain step
            out[m]["ratio_to_compiled"] = round(best[m] / best["plain-compiled"], 3)
    return out


def counts(name: str, methods, steps: int = 5) -> dict:
    """{method: {"aten_ops", "py_calls"}} per step (deterministic, unlike the timings)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile
    out = {}
    for m in methods:
        model, x = workload(name)
        step = make_step(m, model, x)
        try:
            for _ in range(3):
                step()
            with tprofile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step()
            ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
            host = sum(1 for e in prof.events() if e.name.startswith("aten::") and not _in_kernel(e))
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(steps):
                step()
            pr.disable()
            calls = sum(v[1] for v in pstats.Stats(pr).stats.values())
        finally:
            step.close()
        out[m] = {"aten_ops": round(ops / steps), "host_ops": round(host / steps),
                  "py_calls": round(calls / steps)}
    return out


# elasticlab's kernel operators: the ATen ops they dispatch inside are the device's own (a CPU kernel's GEMMs
# are ATen calls, a CUDA kernel's are cuBLAS calls), so ``host_ops`` leaves them out: what is left is the host
# work both devices share.
_KERNEL_OPS = frozenset(f"elasticlab::{k.split('.')[0]}" for k in kernels._CXX_NEEDS if k != "conv_patches")


def _in_kernel(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name in _KERNEL_OPS:
            return True
        p = p.cpu_parent
    return False


def profile(name: str, steps: int, top: int) -> None:
    model, x = workload(name)
    step = make_step("psgn", model, x)
    for _ in range(10):
        step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    step.close()
    print(f"---- cProfile of {steps} psgn steps of {name} (top {top} by own time)")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="mlp24,seq24")
    ap.add_argument("--methods", default="plain,psgn,psgn-torchops,psgn-hooks")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--conv-form", choices=tuple(CONV_FORMS), default="auto",
                    help="the C++ convolution's form for conv24 (CUDA's outer and Gram forms on the CPU)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--compile-backend", default=COMPILE_BACKEND,
                    help="torch.compile backend of plain-compiled and psgn-compiled (e.g. aot_eager)")
    args = ap.parse_args(argv)
    globals()["COMPILE_BACKEND"] = args.compile_backend
    torch.set_num_threads(args.threads)
    if args.conv_form != "auto":             # every shape to one form (the rule's per-shape choice replaced)
        from elasticlab.gns.layers import conv as conv_rule
        conv_rule._cxx_form = lambda module, x, dtype, form=CONV_FORMS[args.conv_form]: form
    methods = [m for m in args.methods.split(",") if m]
    if "plain" not in methods:
        methods.insert(0, "plain")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    res = {"threads": args.threads, "clock": args.clock, "torch": torch.__version__, "layers": LAYERS,
           "workloads": {}}
    for name in args.workloads.split(","):
        r = time_workload(name, methods, args.rounds, args.steps, clock)
        r["counts"] = counts(name, methods)
        res["workloads"][name] = r
        line = "  ".join(f"{m} {r[m]['us']:.0f} us ({r[m]['ratio']:.2f}x, median {r[m]['ratio_med']:.2f}x; "
                         f"+{r[m]['extra_us_per_layer']:.1f} us/layer)" for m in methods if m != "plain")
        print(f"{name}: plain {r['plain_us']:.0f} us  {line}", flush=True)
        if "ratio_to_compiled" in r.get("psgn-compiled", {}):
            rc = r["psgn-compiled"]["ratio_to_compiled"]
            print(f"   psgn-compiled / plain-compiled: {rc:.2f}x", flush=True)
        print("   per step: " + "  ".join(f"{m} {c['aten_ops']} aten ops ({c['host_ops']} outside kernels), "
                                         f"{c['py_calls']} Python calls" for m, c in r["counts"].items()),
              flush=True)
        if args.profile:
            profile(name, args.steps, args.top)
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
