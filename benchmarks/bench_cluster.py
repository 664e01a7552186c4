"""Benchmark of the local cluster autoscaler: average JCT of three real jobs on 4 slots per policy.

The three jobs of :func:`elasticlab.cluster.experiments.three_jobs` (a communication-bound tiny model, a
compute-bound MLP, a job whose gradient noise scale grows fast; emulated device times, real training) run
under each policy in turn, in this process; the baseline (fixed equal shares) is measured in the same run.
Reported per policy: average and per-job JCT (s), makespan, resizes and the measured restart cost, and the
ratio of each policy's average JCT to equal shares (< 1 is better). ``--quick`` halves the work.
Last line: RESULT {json} with ``<policy>_avg_jct`` keys (goodput_avg_jct, equal_share_avg_jct, ...).
"""
from __future__ import annotations

import argparse
import json
import os

from elasticlab.cluster.experiments import compare_policies


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", default=os.environ.get("ELASTICLAB_QUICK") == "1")
    ap.add_argument("--policies", default="equal_share,goodput,pollux,saxena,fifo",
                    help="comma-separated; equal_share (the baseline) is always run")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    pols = [p.strip() for p in a.policies.split(",") if p.strip()]
    if "equal_share" not in pols:
        pols.insert(0, "equal_share")
    out = compare_policies(pols, quick=a.quick, slots=a.slots, interval=a.interval, timeout=a.timeout,
                           progress=True)
    base = out["equal_share_avg_jct"]
    result = {"slots": a.slots, "quick": a.quick, "interval_s": a.interval}
    for p in pols:
        run = out["runs"][p]
        avg = run["avg_jct"]
        result[f"{p}_avg_jct"] = avg
        result[f"{p}_jct"] = run["jct"]
        result[f"{p}_makespan"] = run["makespan"]
        result[f"{p}_all_finished"] = all(s == "finished" for s in run["states"].values())
        result[f"{p}_samples_exactly_once"] = all(run.get("samples_ok", {}).values())
        result[f"{p}_restart_cost_s"] = run["restart_cost"]["estimate_s"]
        result[f"{p}_resizes"] = sum(run["restarts"].values())
        if avg is not None and base:
            result[f"{p}_vs_equal_share"] = avg / base
        jobs = ", ".join(f"{k} {v:.1f}s" for k, v in run["jct"].items())
        print(f"{p:12s} avg JCT {avg if avg is None else round(avg, 2)} s  ({jobs})  "
              f"makespan {run['makespan']:.1f}s  resizes {result[f'{p}_resizes']}  "
              f"restart cost {result[f'{p}_restart_cost_s']:.2f}s", flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
