"""Per-example gradient norms: cost of a training step with norms against plain forward+backward.

Workloads W1–W4 of ``shared/reference/psgnorm-anchors.md``; float32, median of timed steps after warm-up,
methods interleaved round by round so that drift hits all alike. Methods: ``plain`` (the baseline),
``psgn`` (elasticlab, fused backward), ``psgn-ref`` (the same with the compiled kernels off),
``psgn-hooks`` (elasticlab, hooks only), ``torch.func`` (vmap of grad,
then the gradient as the sum of per-example ones) and ``opacus-ghost`` (Opacus ghost clipping, one backward)
when Opacus is installed. Every method is first checked against ``torch.func`` in float64.
Peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the peak RSS of a child process per method.
Last line: ``RESULT {json}`` with each workload's ratio to plain and extra peak memory (MB, % of baseline).

    python benchmarks/bench_psgnorm.py [--device cuda] [--iters 15] [--threads 2] [--quick]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import PerSampleGradNorms, kernels
from elasticlab.gns.reference import func_sq_norms

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(x, **_):
        return x


# ---------------------------------------------------------------------------------------------- workloads
class SeqBlock(nn.Module):
    """W2/W3: Linear D→4D, GELU, Linear 4D→D, LayerNorm, mean over T, Linear D→10."""

    def __init__(self, D=256, C=10):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, C)

    def forward(self, x):
        return self.head(self.ln(self.down(F.gelu(self.up(x)))).mean(1))


class SmallCNN(nn.Module):
    """W4: Conv 3→32 (3×3, pad 1), ReLU, MaxPool2, Conv 32→64, ReLU, MaxPool2, Linear 4096→10."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(4096, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        return self.fc(F.max_pool2d(F.relu(self.c2(h)), 2).flatten(1))


def workload(name: str, quick: bool = False):
    """(model, x, y) of workload W1–W4 (``quick`` shrinks the batch for smoke runs)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "W1":
        B = 32 if quick else 256
        mlp = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                            nn.Linear(1024, 10))
        return (mlp, torch.randn(B, 784, generator=g), torch.randint(0, 10, (B,), generator=g))
    if name in ("W2", "W3"):
        B, T = (32, 128) if name == "W2" else (8, 512)
        if quick:
            B = 4
        return SeqBlock(), torch.randn(B, T, 256, generator=g), torch.randint(0, 10, (B,), generator=g)
    if name == "W4":
        B = 16 if quick else 128
        return SmallCNN(), torch.randn(B, 3, 32, 32, generator=g), torch.randint(0, 10, (B,), generator=g)
    raise ValueError(f"unknown workload {name!r} (W1, W2, W3, W4)")


# ---------------------------------------------------------------------------------------------- methods
def _have_opacus() -> bool:
    try:
        import opacus  # noqa: F401
        return True
    except ImportError:
        return False


def make_step(method: str, model: nn.Module, x, y):
    """A closure running one training step (forward, backward, norms); returns the (B,) squared norms."""
    if method == "plain":
        def step():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        return step
    if method == "psgn-ref":                           # elasticlab with its kernels off (reference path)
        inner = make_step("psgn", model, x, y)

        def step():
            kernels.USE_KERNELS = False
            try:
                return inner()
            finally:
                kernels.USE_KERNELS = True
        step.close = inner.close
        return step
    if method in ("psgn", "psgn-hooks"):
        ctx = PerSampleGradNorms(model, fused=method == "psgn").__enter__()

        def step():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            return ctx.sq_norms()
        step.close = lambda: ctx.__exit__(None, None, None)
        return step
    if method == "torch.func":
        from torch.func import functional_call, grad, vmap
        names = [k for k, _ in model.named_parameters()]

        def one(p, xi, yi):
            return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        def step():
            params = {k: v.detach() for k, v in model.named_parameters()}
            g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
            norms = sum(v.flatten(1).pow(2).sum(1) for v in g.values())
            for k, p in zip(names, model.parameters()):
                p.grad = g[k].mean(0)
            return norms
        return step
    if method == "opacus-ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        gm = GradSampleModuleFastGradientClipping(model, loss_reduction="mean", use_ghost_clipping=True)

        def step():
            gm.zero_grad(set_to_none=True)
            F.cross_entropy(gm(x), y).backward()
            return gm.get_norm_sample().pow(2)        # Opacus returns norms, not squared norms
        step.close = lambda: gm._close()
        return step
    raise ValueError(f"unknown method {method!r}")


def close(step) -> None:
    if hasattr(step, "close"):
        step.close()


def check_methods(name: str, methods, device) -> dict:
    """Max relative error of each method's squared norms against torch.func, in float64 (small batch)."""
    model, x, y = workload(name, quick=True)
    model, x, y = model.double().to(device), x[:8].to(device), y[:8].to(device)
    if x.is_floating_point():
        x = x.double()
    ref = func_sq_norms(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y)   # ‖∇ℓ_i‖²
    errs = {}
    for m in methods:
        if m == "plain":
            continue
        step = make_step(m, model, x, y)
        got = step()
        close(step)
        errs[m] = float(((got - ref).abs() / ref.abs().clamp_min(1e-30)).max())
    return errs


# ---------------------------------------------------------------------------------------------- timing
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_methods(name: str, methods, device, iters: int, warmup: int, quick: bool,
                 clock=time.perf_counter) -> dict:
    model, x, y = workload(name, quick)
    model, x, y = model.to(device), x.to(device), y.to(device)
    steps = {m: make_step(m, copy.deepcopy(model), x, y) for m in methods}   # one model per method
    times = {m: [] for m in methods}
    slow = set()
    try:
        for r in tqdm(range(warmup + iters), desc=name, leave=False, disable=not sys.stderr.isatty()):
            for m in methods:
                if m in slow and r >= warmup + 3:
                    continue
                if device.type == "cuda":
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    steps[m]()
                    t1.record()
                    _sync(device)
                    dt = t0.elapsed_time(t1) / 1e3
                else:
                    t = clock()
                    steps[m]()
                    dt = clock() - t
                if r >= warmup or (r == 0 and dt > 1.0):
                    times[m].append(dt)
                if dt > 1.0:
                    slow.add(m)                        # torch.func on W1: a few timings suffice
    finally:
        for s in steps.values():
            close(s)
    return {m: statistics.median(v) for m, v in times.items()}


def peak_memory(name: str, method: str, device, quick: bool) -> float:
    """Peak bytes of a step beyond what model and data hold (CUDA), or the child process's peak RSS (CPU)."""
    if device.type == "cuda":
        model, x, y = workload(name, quick)
        model, x, y = model.to(device), x.to(device), y.to(device)
        step = make_step(method, model, x, y)
        step()
        model.zero_grad(set_to_none=True)
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        close(step)
        return float(peak)
    cmd = [sys.executable, __file__, "--mem-child", name, method, "--threads", str(torch.get_num_threads())]
    if quick:
        cmd.append("--quick")
    # Large blocks straight from mmap, so that freed memory leaves the RSS and its peak is the step's.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return float(out.strip().splitlines()[-1])


def _status_kb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def _mem_child(name: str, method: str, quick: bool) -> None:
    """Peak RSS of steps 2–3 above the RSS before them (VmHWM reset through /proc/self/clear_refs)."""
    model, x, y = workload(name, quick)
    step = make_step(method, model, x, y)
    step()                                             # first step: grads, lazily built state
    model.zero_grad(set_to_none=True)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_kb("VmRSS")
        for _ in range(2):
            step()
        print(_status_kb("VmHWM") - base)
    except OSError:                                    # no clear_refs: fall back to ru_maxrss
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
        for _ in range(2):
            step()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0 - base)


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--workloads", default="W1,W2,W3,W4")
    ap.add_argument("--methods", default="plain,psgn,psgn-ref,psgn-hooks,torch.func,opacus-ghost")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time, steadier on a busy machine (use with --threads 1)")
    ap.add_argument("--quick", action="store_true", help="small batches and few iterations (smoke test)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--mem-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.mem_child:
        _mem_child(*args.mem_child, args.quick)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    methods = [m for m in args.methods.split(",") if m]
    if "opacus-ghost" in methods and not _have_opacus():
        print("opacus not installed: skipping opacus-ghost (pip install 'elasticlab[bench]')")
        methods.remove("opacus-ghost")
    if methods[0] != "plain":
        methods = ["plain"] + [m for m in methods if m != "plain"]
    iters, warmup = (3, 1) if args.quick else (args.iters, args.warmup)
    from elasticlab import _ext
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, _C built {_ext.HAS_C}, "
          f"kernels {_ext.operators()}")
    result = {"device": str(device), "threads": torch.get_num_threads(), "clock": args.clock, "workloads": {}}
    for w in args.workloads.split(","):
        errs = check_methods(w, methods, device)
        bad = {m: e for m, e in errs.items() if e > 1e-6}
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        med = time_methods(w, methods, device, iters, warmup, args.quick, clock)
        base = med["plain"]
        entry = {"baseline_ms": base * 1e3, "ratio": {}, "check_rel_err": errs}
        print(f"\n{w}: plain {base * 1e3:.2f} ms  (check vs torch.func, float64: "
              + ", ".join(f"{m} {e:.1e}" for m, e in errs.items()) + ")")
        if not args.no_memory:
            mem = {m: peak_memory(w, m, device, args.quick) for m in methods}
            entry["baseline_peak_mb"] = mem["plain"] / 2**20
            entry["extra_mb"] = {m: (mem[m] - mem["plain"]) / 2**20 for m in methods if m != "plain"}
            entry["extra_pct"] = {m: 100 * (mem[m] - mem["plain"]) / max(mem["plain"], 1.0)
                                  for m in methods if m != "plain"}
        for m in methods[1:]:
            entry["ratio"][m] = med[m] / base
            line = f"  {m:13s} {med[m] * 1e3:9.2f} ms  {med[m] / base:6.2f}x"
            if not args.no_memory:
                line += f"  extra peak {entry['extra_mb'][m]:+8.1f} MB ({entry['extra_pct'][m]:+.1f}%)"
            print(line)
        if bad:
            print(f"  WARNING: methods disagree with torch.func: {bad}")
        result["workloads"][w] = entry
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
