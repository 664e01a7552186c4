"""How the simulator's cost grows with the cluster and the trace (issue 19): Philly windows and clusters of
1x, 4x, 16x a base size (default 4 nodes x 4 GPUs and 1.5 h of the trace from hour 1000, so 16x is 64x4
and 24 h, ~1250 jobs), each policy timed at each scale; ratios are against the 1x run of the same policy in
the same process. ``--whole`` adds the whole trace on 640x4 (tens of minutes to hours on 2 cores).
CPU seconds are reported beside wall seconds (robust to other load on the machine).
Last line: RESULT {json}.
"""
from __future__ import annotations

import argparse
import json
import resource
import time

from elasticlab.sim import simulate, trace_workload


def run(workload, policy, cluster):
    c0, t0 = time.process_time(), time.perf_counter()
    res = simulate(workload, policy, cluster=cluster, progress=False)
    return res, time.process_time() - c0, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policies", default="goodput,tiresias")
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--base-nodes", type=int, default=4)
    ap.add_argument("--base-hours", type=float, default=1.5)
    ap.add_argument("--start", type=float, default=1000.0, help="window start, hours into the trace")
    ap.add_argument("--quick", action="store_true", help="scales 1 and 4 only")
    ap.add_argument("--whole", action="store_true", help="also the whole trace on 640x4")
    args = ap.parse_args(argv)
    scales = [1, 4] if args.quick else [int(s) for s in args.scales.split(",")]
    policies = args.policies.split(",")
    simulate(trace_workload("philly", start=args.start, hours=0.2), "fifo", cluster="2x4", progress=False)
    out = {}
    cases = [(s, trace_workload("philly", start=args.start, hours=args.base_hours * s),
              f"{args.base_nodes * s}x4") for s in scales]
    if args.whole:
        cases.append(("whole", trace_workload("philly"), "640x4"))
    for scale, w, cluster in cases:
        for pol in policies:
            res, cpu, wall = run(w, pol, cluster)
            s = res.summary
            key = f"{pol}_x{scale}"
            base = out.get(f"{pol}_x{scales[0]}")
            out[key] = {"jobs": len(w), "cluster": cluster, "rounds": s["rounds"], "cpu_s": cpu,
                        "wall_s": wall,
                        "cpu_ms_per_round": 1e3 * cpu / max(s["rounds"], 1), "avg_jct": s["avg_jct"],
                        "p99_jct": s["p99_jct"], "makespan": s["makespan"],
                        "gpu_utilisation": s.get("gpu_utilisation"),
                        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                        "cpu_ratio_vs_x1": cpu / base["cpu_s"] if base else 1.0}
            r = out[key]
            print(f"{key:18s} {len(w):6d} jobs on {cluster:6s} {s['rounds']:7d} rounds  cpu {cpu:8.1f} s "
                  f"(x{r['cpu_ratio_vs_x1']:6.1f})  wall {wall:8.1f} s  "
                  f"{r['cpu_ms_per_round']:6.2f} ms/round  "
                  f"avg JCT {s['avg_jct']:8.0f} s  peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    print("RESULT " + json.dumps({"results": out}))


if __name__ == "__main__":
    main()
