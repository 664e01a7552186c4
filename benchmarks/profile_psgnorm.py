"""Where the time of a G1 step with per-example norms goes: top kernels by self time, fp32 and bf16 autocast.

Builds workload G1 of ``bench_psgnorm.py`` (GPT-2-small class, B=8, T=1024; ``--quick``: 2 layers, D=256,
T=128), runs ``--warmup`` steps of the ``psgn`` method (elasticlab, fused backward), then profiles
``--steps`` steps with ``torch.profiler`` and prints the top-10 kernels by self CUDA time (total ms over
the profiled steps, ms a step, % of all kernel time, name cut to 90 characters), and the plain model's
top-5 for comparison, at each precision. On CPU (``--device cpu``, a smoke test) the same for CPU operators
by self CPU time. On CUDA also the GPU's idle time within the profiled steps (the span from the first
kernel to the last, less the union of kernels and copies) and its longest gaps, each with the kernel that
ended it: where the device waited for the host. Where the method's extra host time goes (a host-bound
step, e.g. G2): the operators whose self CPU time a step grew most over plain (ATen operators, elasticlab's,
autograd nodes and, on CUDA, runtime calls such as ``cudaLaunchKernel``), with their extra calls a step, and
what of the wall time's extra no operator holds (Python between operators); on CUDA likewise the kernels
whose device time a step grew most (where the method's extra device time goes, kernel by kernel). A
precision whose step raises is reported as ``error: ...`` and the others go on.
``--kernels off`` sets ``elasticlab.gns.kernels.USE_KERNELS = False`` (the PyTorch reference paths);
``--method`` profiles another method of ``bench_psgnorm.py`` than ``psgn`` (e.g. ``psgn-convtriton``, one
with a switch flipped; a ``psgn-calibrated`` warm-up does the measuring).
Last line: ``RESULT {json}``.

    python benchmarks/profile_psgnorm.py [--device cuda] [--precision fp32,bf16] [--kernels on|off]
        [--method psgn] [--steps 3] [--warmup 3] [--top 10] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_psgnorm as bench  # noqa: E402

from elasticlab.gns import kernels  # noqa: E402

NAME_WIDTH = 90


def _device_kind(evt) -> str:
    return str(getattr(evt, "device_type", "")).rsplit(".", 1)[-1]


def top_events(evts, device, k: int, steps: int) -> dict:
    """{"total_ms_per_step", "top": [{"name", "ms", "pct"}]}: of a profile's averaged events (``evts``,
    ``prof.key_averages()``), the k largest device kernels by self device time (CUDA, :func:`device_ops`), or
    CPU operators by self CPU time (CPU); ms summed over the profiled steps."""
    if device.type == "cuda":
        rows = [(key, t) for key, (t, _) in device_ops(evts).items()]
        if not rows:                                   # no separate kernel events: CPU ops' device time
            rows = [(e.key, e.self_device_time_total) for e in evts if e.self_device_time_total > 0]
    else:
        rows = [(e.key, e.self_cpu_time_total) for e in evts]
    total = sum(t for _, t in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    return {"total_ms_per_step": total / 1e3 / steps,
            "top": [{"name": n[:NAME_WIDTH], "ms": t / 1e3, "pct": 100.0 * t / total} for n, t in rows[:k]]}


def idle_gaps(intervals, steps: int, k: int = 5) -> dict:
    """Where the device waits: ``intervals`` are (start, end, name) of its kernels and copies in µs. The busy
    time is their union; the idle time is what the span from the first start to the last end leaves. Returns
    {"idle_ms_per_step", "span_ms_per_step", "gaps": the k longest gaps as {"ms", "before", "after"}: the
    activity that ended the gap and the one that preceded it}."""
    ivs = sorted(intervals)
    if not ivs:
        return {"idle_ms_per_step": 0.0, "span_ms_per_step": 0.0, "gaps": []}
    gaps, busy_end, prev = [], ivs[0][1], ivs[0][2]
    for start, end, name in ivs[1:]:
        if start > busy_end:
            gaps.append((start - busy_end, name, prev))
        if end >= busy_end:
            busy_end, prev = end, name
    span = busy_end - ivs[0][0]
    gaps.sort(key=lambda g: -g[0])
    top = [{"ms": g / 1e3, "before": b[:NAME_WIDTH], "after": a[:NAME_WIDTH]} for g, b, a in gaps[:k]]
    return {"idle_ms_per_step": sum(g[0] for g in gaps) / 1e3 / steps, "span_ms_per_step": span / 1e3 / steps,
            "gaps": top}


def launch_counts(events, steps: int) -> dict:
    """Per step: device kernels (and copies) launched, and ATen operators dispatched on the host (nested ones
    included): what a host-bound step pays for, one launch or dispatch at a time."""
    kernels = sum(1 for e in events if _device_kind(e) == "CUDA")
    aten = sum(1 for e in events if _device_kind(e) != "CUDA" and e.name.startswith("aten::"))
    return {"kernels_per_step": kernels / steps, "aten_ops_per_step": aten / steps}


def host_ops(evts) -> dict[str, tuple[float, int]]:
    """{operator: (self CPU µs, calls)} over the profiled steps, host side (device kernels left out), from a
    profile's averaged events (``prof.key_averages()``)."""
    return {e.key: (e.self_cpu_time_total, e.count) for e in evts if _device_kind(e) != "CUDA"}


def device_ops(evts) -> dict[str, tuple[float, int]]:
    """{kernel: (self device µs, launches)} over the profiled steps (CUDA kernels and copies; none on a CPU
    run), from a profile's averaged events."""
    return {e.key: (e.self_device_time_total, e.count) for e in evts if _device_kind(e) == "CUDA"}


def host_extra(method: dict, plain: dict, steps: int, k: int) -> dict:
    """The method's extra work a step over plain, from two :func:`host_ops` (or two :func:`device_ops`):
    {"ms_per_step": the self time of all operators (kernels), method less plain, "top": the k that grew most,
    as {"name", "ms" a step, "calls" a step more}}."""
    rows = []
    for key in set(method) | set(plain):
        (mt, mc), (pt, pc) = method.get(key, (0.0, 0)), plain.get(key, (0.0, 0))
        rows.append((key, (mt - pt) / 1e3 / steps, (mc - pc) / steps))
    rows.sort(key=lambda r: -r[1])
    return {"ms_per_step": sum(r[1] for r in rows),
            "top": [{"name": n[:NAME_WIDTH], "ms": ms, "calls": c} for n, ms, c in rows[:k]]}


def _device_intervals(prof) -> list[tuple[float, float, str]]:
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if _device_kind(e) == "CUDA"]


def profile_method(method: str, prec: str, device, args, k: int) -> dict:
    """Warm up, then profile ``args.steps`` steps of ``method`` on ``args.workload`` at ``prec``."""
    model, x, y = bench.build(args.workload, device, args.quick)
    step = bench.make_step(method, model, x, y, prec)
    try:
        for _ in range(args.warmup):
            step()
        bench._sync(device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()                     # (the profiler's own start-up left out)
            for _ in range(args.steps):
                step()
            bench._sync(device)
            wall = (time.perf_counter() - t0) / args.steps
    finally:
        bench.close(step)
        del model, step
        bench._free_cuda(device)
    evts = prof.key_averages()                          # (averaged once: it walks every event)
    out = top_events(evts, device, k, args.steps)
    out["wall_ms_per_step_profiled"] = wall * 1e3
    out.update(launch_counts(prof.events(), args.steps))
    out["host_ops"] = host_ops(evts)              # (for host_extra; left out of the RESULT line)
    out["device_ops"] = device_ops(evts)
    if device.type == "cuda":
        out["idle"] = idle_gaps(_device_intervals(prof), args.steps)
    return out


def print_top(label: str, res: dict, device, steps: int) -> None:
    if "error" in res:
        print(f"\n{label}: {res['error']}")
        return
    unit = "kernel" if device.type == "cuda" else "CPU op"
    print(f"\n{label}: {unit} time {res['total_ms_per_step']:.2f} ms/step "
          f"(wall {res['wall_ms_per_step_profiled']:.2f} ms/step under the profiler); per step "
          f"{res['kernels_per_step']:.0f} kernels, {res['aten_ops_per_step']:.0f} ATen ops")
    print(f"  {'total ms':>9s} {'ms/step':>8s} {'%':>5s}  name")
    for r in res["top"]:
        print(f"  {r['ms']:9.2f} {r['ms'] / steps:8.2f} {r['pct']:5.1f}  {r['name']}")
    if "idle" in res:
        idle = res["idle"]
        print(f"  GPU idle {idle['idle_ms_per_step']:.2f} ms/step of a {idle['span_ms_per_step']:.2f} ms "
              "span (first kernel to last); longest gaps:")
        for g in idle["gaps"]:
            print(f"  {g['ms']:9.3f} ms before {g['before'][:60]}  (after {g['after'][:50]})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--precision", default="fp32,bf16")
    ap.add_argument("--workload", default="G1", help="a workload of bench_psgnorm (default G1)")
    ap.add_argument("--kernels", choices=["on", "off"], default="on")
    ap.add_argument("--method", default="psgn", help="the method profiled against plain (default psgn)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small G1 (2 layers, D=256, T=128): a smoke test")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available (use --device cpu --quick)")
    kernels.USE_KERNELS = args.kernels == "on"
    from elasticlab import _ext
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, _C built {_ext.HAS_C}, USE_KERNELS {kernels.USE_KERNELS}, "
          f"{args.workload}{' quick' if args.quick else ''}, "
          f"{args.steps} profiled steps after {args.warmup} warm-up")
    result = {"device": str(device), "torch": torch.__version__, "kernels": args.kernels,
              "method": args.method, "quick": args.quick, "steps": args.steps, "precisions": {}}
    for prec in [p for p in args.precision.split(",") if p]:
        res = {}
        for method, k in ((args.method, args.top), ("plain", min(5, args.top))):
            try:
                res[method] = profile_method(method, prec, device, args, k)
            except Exception as e:
                res[method] = {"error": bench.error_text(e)}
            print_top(f"{args.workload}-{prec} {method} (top {k})", res[method], device, args.steps)
        m = args.method
        if "error" not in res[m] and "error" not in res["plain"]:
            res[f"{m}_over_plain"] = res[m]["total_ms_per_step"] / res["plain"]["total_ms_per_step"]
            print(f"  {m}/plain {'kernel' if device.type == 'cuda' else 'CPU op'} time: "
                  f"{res[f'{m}_over_plain']:.2f}x; kernels {res[m]['kernels_per_step']:.0f} vs "
                  f"{res['plain']['kernels_per_step']:.0f}, ATen ops {res[m]['aten_ops_per_step']:.0f} vs "
                  f"{res['plain']['aten_ops_per_step']:.0f} a step")
            extra = res[f"{m}_host_extra"] = host_extra(res[m]["host_ops"], res["plain"]["host_ops"],
                                                          args.steps, args.top)
            wall = res[m]["wall_ms_per_step_profiled"] - res["plain"]["wall_ms_per_step_profiled"]
            extra["wall_ms_per_step"] = wall
            print(f"  host: {m} takes {wall:.2f} ms/step more wall time than plain under the profiler, its "
                  f"operators {extra['ms_per_step']:.2f} ms/step more self CPU time\n"
                  f"  (the rest, {wall - extra['ms_per_step']:.2f} ms, in no operator: Python between them); "
                  "the operators that grew most:")
            for r in extra["top"]:
                print(f"  {r['ms']:9.3f} ms/step {r['calls']:+6.0f} calls  {r['name']}")
            if res[m]["device_ops"] or res["plain"]["device_ops"]:
                dev = res[f"{m}_device_extra"] = host_extra(res[m]["device_ops"], res["plain"]["device_ops"],
                                                            args.steps, args.top)
                print(f"  device: {m}'s kernels take {dev['ms_per_step']:.2f} ms/step more than plain's; the "
                      "kernels that grew most (time and launches a step):")
                for r in dev["top"]:
                    print(f"  {r['ms']:9.3f} ms/step {r['calls']:+6.0f} launches  {r['name']}")
        for r in res.values():
            if isinstance(r, dict):
                r.pop("host_ops", None)
                r.pop("device_ops", None)
        result["precisions"][prec] = res
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
