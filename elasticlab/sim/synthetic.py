"""Saxena et al.'s setting (MASCOTS 2020, P1-T3): Poisson arrivals, an autoscaler that re-solves the DP at
every arrival and completion, admission by drop or by a waiting queue.

Job j: throughput Thr_j(b, k) = b / (t_j(b/k) + c_j(k)) samples/s, with per-GPU compute
t_j(m) = alpha_j + beta_j m and communication c_j(k) = 0 for k = 1, else delta_j (1 + log2 k); per-GPU
batch at most mem_j; work W_j samples (the same whatever the batch: P1's premise). Utility of g GPUs =
best throughput over the allowed batches (batch folded in, Saxena's DP): the batch-elastic policy may use
any batch in [b_min, b_max] (powers of two times b_min); the GPU-only baseline keeps b = b_min.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from elasticlab.alloc.dp import dp_allocate
from elasticlab.sim.metrics import summarize

__all__ = ["SyntheticJobs", "synthetic_jobs", "best_throughput", "simulate_synthetic"]


@dataclass
class SyntheticJobs:
    arrival: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    delta: np.ndarray
    b_user: np.ndarray
    b_min: np.ndarray
    b_max: np.ndarray
    mem: np.ndarray
    work: np.ndarray
    max_gpus: np.ndarray

    def __len__(self):
        return len(self.arrival)


def synthetic_jobs(n_jobs=None, mean_interarrival=60.0, horizon=6 * 3600.0, batch_range=8, seed=0,
                   mean_hours=1.0) -> SyntheticJobs:
    """Poisson arrivals over ``horizon`` seconds (or exactly ``n_jobs``). Each job has a user batch b_u
    that needs 1, 2 or 4 GPUs' memory; the batch-elastic range is [b_u / min(4, r), that x r] with
    r = ``batch_range`` (8: Saxena's eightfold range; 1: the null case, min batch == max batch)."""
    if mean_interarrival <= 0 or horizon <= 0 or batch_range < 1:
        raise ValueError(f"need mean_interarrival > 0, horizon > 0, batch_range >= 1; got "
                         f"{mean_interarrival}, {horizon}, {batch_range}")
    rng = np.random.default_rng(seed)
    if n_jobs is None:
        gaps = rng.exponential(mean_interarrival, size=int(3 * horizon / mean_interarrival) + 10)
        arrival = np.cumsum(gaps)
        arrival = arrival[arrival < horizon]
    else:
        arrival = np.cumsum(rng.exponential(mean_interarrival, size=int(n_jobs)))
    n = len(arrival)
    b_user = 2.0 ** rng.integers(6, 9, n)  # the user's batch: 64..256
    mem = b_user / 2.0 ** rng.integers(0, 3, n)  # it needs 1, 2 or 4 GPUs' memory
    alpha = rng.uniform(0.02, 0.1, n)
    beta = rng.uniform(5e-4, 2e-3, n)
    delta = rng.uniform(0.02, 0.1, n)
    k_user = b_user / mem
    comm = np.where(k_user > 1, 1.0 + np.log2(k_user), 0.0)
    thr_user = b_user / (alpha + beta * mem + delta * comm)
    hours = rng.lognormal(np.log(mean_hours) - 0.5, 1.0, n)
    work = thr_user * hours * 3600.0  # samples; the same whatever the batch (P1's premise)
    max_gpus = np.full(n, 16)
    b_min = b_user / min(4, int(batch_range))
    b_max = b_min * int(batch_range)
    return SyntheticJobs(arrival, alpha, beta, delta, b_user, b_min, b_max, mem, work, max_gpus)


def best_throughput(jobs: SyntheticJobs, capacity: int, elastic: bool) -> np.ndarray:
    """(J, capacity+1) table: best samples/s of each job on g GPUs over its allowed batches (-inf if none)."""
    n = len(jobs)
    g = np.arange(capacity + 1, dtype=float)
    out = np.full((n, capacity + 1), -np.inf)
    out[:, 0] = 0.0
    gg = g[1:]
    comm = np.where(gg > 1, 1.0 + np.log2(np.maximum(gg, 1)), 0.0)
    for j in range(n):
        if elastic:
            n_b = int(round(math.log2(jobs.b_max[j] / jobs.b_min[j]))) + 1
            batches = jobs.b_min[j] * 2.0 ** np.arange(n_b)
        else:
            batches = np.array([jobs.b_user[j]])
        per_gpu = batches[:, None] / gg[None, :]
        t = jobs.alpha[j] + jobs.beta[j] * per_gpu + jobs.delta[j] * comm[None, :]
        thr = np.where((per_gpu <= jobs.mem[j]) & (per_gpu >= 1) & (gg[None, :] <= jobs.max_gpus[j]),
                       batches[:, None] / t, -np.inf)
        out[j, 1:] = thr.max(axis=0)
    return out


def simulate_synthetic(jobs: SyntheticJobs, capacity: int = 64, elastic: bool = True, admission: str = "drop",
                       restart_delay: float = 0.0, until: float | None = None) -> dict:
    """Event-driven run; returns the summary dict plus per-job arrays (jct, completed, dropped).

    admission: "drop" (an arrival that makes the DP infeasible is rejected, Saxena's patent claim 8) or
    "queue" (it waits, FIFO, until the DP can admit it; JCT then includes the wait).
    ``until``: stop the clock there (default: the last arrival); jobs done by then count as completed.
    """
    if admission not in ("drop", "queue"):
        raise ValueError(f"admission must be 'drop' or 'queue', got {admission!r}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    table = best_throughput(jobs, capacity, elastic)
    n = len(jobs)
    remaining = jobs.work.astype(float).copy()
    alloc = np.zeros(n, dtype=np.int64)
    running: list[int] = []
    queue: list[int] = []
    completion = np.full(n, np.nan)
    dropped = np.zeros(n, dtype=bool)
    stall = np.zeros(n)  # restart time left
    t = 0.0
    nxt_arrival = 0
    rounds = 0
    until = float(jobs.arrival[-1]) if until is None and n else (until or 0.0)

    def solve(cands):
        return dp_allocate(table[cands], capacity, min_gpus=1)

    def reallocate():
        nonlocal running, rounds
        rounds += 1
        # admit from the queue in FIFO order while feasible
        while queue:
            try:
                solve(running + [queue[0]])
            except ValueError:
                break
            running.append(queue.pop(0))
        if running:
            a = solve(running)
            for j, g in zip(running, a):
                if alloc[j] != g and alloc[j] > 0:
                    stall[j] = restart_delay
                alloc[j] = g

    while True:
        rates = np.array([table[j, alloc[j]] for j in running]) if running else np.zeros(0)
        t_done = np.inf
        j_done = -1
        for i, j in enumerate(running):
            dt = stall[j] + remaining[j] / rates[i]
            if dt < t_done:
                t_done, j_done = dt, j
        t_arr = jobs.arrival[nxt_arrival] - t if nxt_arrival < n else np.inf
        if not np.isfinite(t_done) and not np.isfinite(t_arr):
            break
        dt = min(t_done, t_arr)
        if t + dt > until:
            break
        for i, j in enumerate(running):
            s = min(stall[j], dt)
            stall[j] -= s
            remaining[j] -= rates[i] * (dt - s)
        t += dt
        if t_done <= t_arr:
            completion[j_done] = t
            remaining[j_done] = 0.0
            running.remove(j_done)
            alloc[j_done] = 0
        else:
            j = nxt_arrival
            nxt_arrival += 1
            if admission == "drop":
                try:
                    solve(running + [j])
                    running.append(j)
                except ValueError:
                    dropped[j] = True
            else:
                queue.append(j)
        reallocate()
    df = pd.DataFrame({"name": [f"job-{i}" for i in range(n)], "submission_time": jobs.arrival,
                       "completion_time": completion, "dropped": dropped})
    out = summarize(df)
    out["rounds"] = rounds
    out["jct"] = (completion - jobs.arrival)[~np.isnan(completion)].tolist()
    return out
