"""Benchmark of elasticlab.goodput: one job's ``optimize`` (the agent's batch-size choice, which the
Pollux paper reports at ~0.4 ms), the full 16-node x 4-GPU speedup table the allocator evaluates per
job and round (target < 1 ms), and a throughput-model fit (paper: ~0.2 s).

Baseline, measured in the same run: the table filled the way a memoised per-(N, K) speedup function
does, one scalar ``optimize`` call per allocation. Prints ratios; the last line is ``RESULT {json}``.
Run: ``.venv/bin/python benchmarks/bench_goodput.py [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import sys
import timeit

import numpy as np

from elasticlab import goodput
from elasticlab.goodput import GoodputFunction, ThroughputModel, fit_throughput_model

MODEL = ThroughputModel(alpha_grad=0.05, beta_grad=2e-3, alpha_local=0.02, beta_local=1e-3,
                        alpha_node=0.1, beta_node=5e-3, gamma=2.0)
KW = dict(max_batch=4096, min_per_gpu_batch=32, max_per_gpu_batch=256)  # cifar10-like limits


def best_ms(fn, number, repeat):
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e3


def table_by_loop(gf, max_nodes, gpus_per_node):
    """Baseline: one scalar optimize per valid (N, K), as a memoised speedup function fills its table."""
    table = np.zeros((max_nodes + 1, max_nodes * gpus_per_node + 1))
    g0 = gf.optimize(1, 1, **KW)[0]
    for n in range(1, max_nodes + 1):
        for k in range(n, n * gpus_per_node + 1):
            table[n, k] = gf.optimize(n, k, **KW)[0] / g0
    return table


def observations(rng):
    rows = []
    for nodes, gpus in [(1, 1), (1, 2), (1, 4), (2, 4), (2, 8), (4, 8), (4, 16)]:
        for b in (32, 64, 128, 256):
            t = float(MODEL.iter_time(nodes, gpus, b)) * np.exp(0.05 * rng.normal())
            rows.append((nodes, gpus, b, 0, t))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args(argv)
    rep = 3 if args.quick else 7
    gf = GoodputFunction(MODEL, 1000.0, 128)

    table = gf.speedup_table(16, 4, **KW)
    loop = table_by_loop(gf, 16, 4)
    if not np.allclose(table, loop):
        print("speedup_table disagrees with the per-allocation loop", file=sys.stderr)
        return 1

    opt_ms = best_ms(lambda: gf.optimize(4, 16, **KW), 200, rep)
    table_ms = best_ms(lambda: gf.speedup_table(16, 4, **KW), 50, rep)

    def cold():
        goodput._CANDIDATE_CACHE.clear()
        gf.speedup_table(16, 4, **KW)

    cold_ms = best_ms(cold, 50, rep)
    loop_ms = best_ms(lambda: table_by_loop(gf, 16, 4), 1 if args.quick else 3, rep)
    rows = observations(np.random.default_rng(0))
    fit_throughput_model(rows)  # warm the scipy import
    fit_ms = best_ms(lambda: fit_throughput_model(rows), 1, rep)

    print(f"optimize, one job (4 nodes, 16 GPUs, 50 candidates):  {opt_ms:8.3f} ms   (Pollux paper: ~0.4 ms)")
    print(f"speedup table 16 x 4, vectorised:                      {table_ms:8.3f} ms   (target < 1 ms; "
          "the job's candidate grid cached, as in every round after its first)")
    print(f"speedup table 16 x 4, vectorised, cold cache:          {cold_ms:8.3f} ms")
    print(f"speedup table 16 x 4, one optimize per allocation:     {loop_ms:8.3f} ms   "
          f"(baseline; x{loop_ms / table_ms:.0f} slower)")
    print(f"throughput-model fit, {len(rows)} observations:               {fit_ms:8.1f} ms   "
          "(Pollux paper: ~200 ms)")
    result = {
        "optimize_ms": round(opt_ms, 4),
        "speedup_table_ms": round(table_ms, 4),
        "speedup_table_cold_ms": round(cold_ms, 4),
        "speedup_table_loop_ms": round(loop_ms, 3),
        "table_speedup_vs_loop": round(loop_ms / table_ms, 1),
        "fit_ms": round(fit_ms, 2),
        "table_under_1ms": bool(table_ms < 1.0),
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
