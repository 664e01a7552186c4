"""Overhead of ``GNSMonitor`` on a training step against plain training, on the CPU workloads W1–W4.

The workloads are ``bench_psgnorm.py``'s (W1 MLP B=256, W2/W3 sequence blocks, W4 small CNN B=128). A step is
zero_grad, forward, backward, SGD step. Methods, timed interleaved round by round in the same run:
``plain``; ``monitor`` (``with GNSMonitor(model).step():`` around forward and backward: per-example form);
``by-hand`` (``PerSampleGradNorms`` + ``GNSEstimator.update_from``, what a user would write without the
monitor); ``plain-acc2`` / ``monitor-acc2`` (the batch as two micro-batches of half size: the micro-batch
form against plain accumulation). Timed by the calling thread's CPU time (``time.thread_time``, one intra-op
thread: other processes on a shared machine barely move it; ``--clock wall`` for wall time); per method the
minimum over ``--rounds`` of the mean of ``--steps`` steps. Ratios: monitor / plain, by-hand / plain,
monitor-acc2 / plain-acc2. Last line: ``RESULT {json}``.

    python benchmarks/bench_gns_monitor.py [--workloads W1,W2,W3,W4] [--rounds 5] [--steps 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_psgnorm import loss_fn, workload  # noqa: E402

from elasticlab.gns import GNSEstimator, GNSMonitor, PerSampleGradNorms  # noqa: E402

METHODS = ("plain", "monitor", "by-hand", "plain-acc2", "monitor-acc2")


def stepper(method: str, model, x, y):
    """A function running one training step of ``method`` (its state built once)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    halves = list(zip(x.chunk(2), y.chunk(2)))
    if method == "plain":
        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    elif method == "plain-acc2":
        def step():
            opt.zero_grad()
            for xb, yb in halves:
                (loss_fn(model(xb), yb) / 2).backward()
            opt.step()
    elif method in ("monitor", "monitor-acc2"):
        mon = GNSMonitor(model, method="per_example" if method == "monitor" else "micro_batch")
        parts = [(x, y)] if method == "monitor" else halves

        def step():
            opt.zero_grad()
            with mon.step():
                for xb, yb in parts:
                    (loss_fn(model(xb), yb) / len(parts)).backward()
            opt.step()
        step.monitor = mon
    elif method == "by-hand":
        est, norms = GNSEstimator(), PerSampleGradNorms(model)

        def step():
            opt.zero_grad()
            with norms:
                loss_fn(model(x), y).backward()
                est.update_from(norms)
            opt.step()
    else:
        raise ValueError(f"unknown method {method!r} ({', '.join(METHODS)})")
    return step


def time_workload(name: str, rounds: int, steps: int, quick: bool, clock) -> dict:
    model, x, y = workload(name, quick=quick)
    steppers = {m: stepper(m, model, x, y) for m in METHODS}
    for fn in steppers.values():                     # warm-up (and the first measured steps)
        fn()
        fn()
    best = {m: float("inf") for m in METHODS}
    for _ in range(rounds):
        for m, fn in steppers.items():
            t0 = clock()
            for _ in range(steps):
                fn()
            best[m] = min(best[m], (clock() - t0) / steps)
    b_simple = [float(steppers[m].monitor.b_simple) for m in ("monitor", "monitor-acc2")]
    return {"ms": {m: round(v * 1e3, 3) for m, v in best.items()},
            "ratio_monitor": round(best["monitor"] / best["plain"], 3),
            "ratio_by_hand": round(best["by-hand"] / best["plain"], 3),
            "ratio_monitor_acc2": round(best["monitor-acc2"] / best["plain-acc2"], 3),
            "b_simple": {"per_example": b_simple[0], "micro_batch": b_simple[1]}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W1,W2,W3,W4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--quick", action="store_true", help="small batches (a smoke run)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    out = {}
    for name in a.workloads.split(","):
        out[name] = r = time_workload(name, a.rounds, a.steps, a.quick, clock)
        print(f"{name}: plain {r['ms']['plain']:.2f} ms, monitor x{r['ratio_monitor']:.3f}, by hand "
              f"x{r['ratio_by_hand']:.3f}; two micro-batches: monitor x{r['ratio_monitor_acc2']:.3f}",
              flush=True)
    res = {"clock": a.clock, "threads": a.threads, "quick": a.quick, "workloads": out}
    print("RESULT " + json.dumps(res))
    return res


if __name__ == "__main__":
    main()
