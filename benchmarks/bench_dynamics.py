"""Benchmark of elasticlab.dynamics.train (numba GD kernel) against a plain numpy GD loop, same run.

Cases: the P3-T1 linear net (8→8→8, 8 whitened inputs, 20k steps, recording every 10) and the P3-T4/T5 ReLU
MLP (10→32→32→3 with biases, 200 examples, 3000 steps, recording every 10). Both implementations must agree
to 1e-9 (relative) on the final parameters. Reports the speed-up of the kernel over the numpy loop.
Last line: RESULT {json}.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import elasticlab.dynamics as D


def numpy_train(net, X, Y, lr, steps, record_every):
    """Reference: the same full-batch GD, one numpy call per matrix operation."""
    ws = [w.copy() for w in net.weights]
    bs = [b.copy() for b in net.biases] if net.has_bias else None
    n = X.shape[0]
    rec = []
    for k in range(steps + 1):
        zs, hs = [], [X]
        h = X
        for j, w in enumerate(ws):
            z = h @ w.T
            if bs is not None:
                z = z + bs[j]
            zs.append(z)
            h = np.where(z > 0, z, net.slope * z) if j < len(ws) - 1 else z
            hs.append(h)
        G = (h - Y) / n
        if k % record_every == 0 or k == steps:
            rec.append(np.concatenate([w.ravel() for w in ws] + ([b for b in bs] if bs else [])))
        if k == steps:
            break
        gws, gbs = [None] * len(ws), [None] * len(ws)
        for j in range(len(ws) - 1, -1, -1):
            gws[j] = G.T @ hs[j]
            gbs[j] = G.sum(axis=0)
            if j:
                G = (G @ ws[j]) * np.where(zs[j - 1] > 0, 1.0, net.slope)
        for j in range(len(ws)):
            ws[j] -= lr * gws[j]
            if bs is not None:
                bs[j] -= lr * gbs[j]
    return np.array(rec)


def timed(fn, reps):
    fn()
    best = np.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    a = ap.parse_args(argv)
    f = 0.1 if a.quick else 1.0
    task = D.saxe_task([5, 3, 2, 1, 0.5, 0, 0, 0], seed=0)
    lin = D.random_init((8, 8, 8), 1e-3, slope=1.0, seed=0)
    X, Y = D.regression_task()
    relu = D.random_init((10, 32, 32, 3), 0.3, slope=0.0, biases=True, seed=0, fan_in=True)
    cases = {
        "linear_8x8_20k": (lin, task.X, task.Y, 1e-3, int(20000 * f)),
        "relu_10-32-32-3_3k": (relu, X, Y, 1e-2, int(3000 * f)),
    }
    result = {}
    for name, (net, x, y, lr, steps) in cases.items():
        t_nb, tr = timed(lambda net=net, x=x, y=y, lr=lr, steps=steps: D.train(net, x, y, lr, steps,
                                                                                 record_every=10), a.reps)
        t_np, ref = timed(lambda net=net, x=x, y=y, lr=lr, steps=steps: numpy_train(net, x, y, lr, steps, 10),
                          a.reps)
        err = float(np.abs(tr.params - ref).max() / np.abs(ref).max())
        if err > 1e-9:
            raise SystemExit(f"{name}: numba and numpy trajectories differ (relative {err:.2e})")
        result[name] = {"steps": steps, "numba_s": t_nb, "numpy_s": t_np, "speedup": t_np / t_nb,
                        "us_per_step_numba": 1e6 * t_nb / steps, "max_rel_diff": err}
        print(f"{name:22s} numba {t_nb * 1e3:8.1f} ms  numpy {t_np * 1e3:8.1f} ms"
              f"  speed-up {t_np / t_nb:5.1f}x"
              f"  ({1e6 * t_nb / steps:.1f} µs/step, agree to {err:.1e})")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
