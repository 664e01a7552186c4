"""goodput-DP: elasticlab's own policy -- goodput speedups weighted toward jobs with little attained service.

maximise  sum_j w_j * SPEEDUP_j(g_j) * penalty_j(g_j)  by ``dp_allocate``, where
* SPEEDUP_j is Pollux's goodput speedup over 1 GPU (best batch per count, Pollux Eq. (8));
* w_j = (1 + S_j / s0)^(-q), S_j the attained service in GPU-seconds: least-attained-service priority
  (Tiresias's insight, no oracle needed), which approximates shortest-remaining-first on heavy-tailed
  job sizes and so lowers the average JCT; q = 0 gives plain total goodput;
* penalty_j: Pollux's re-allocation penalty on every count other than the current one.
Every job gets at least one GPU while GPUs last (FIFO), so nobody starves.
"""
from __future__ import annotations

import time

import numpy as np

from elasticlab.alloc.dp import dp_allocate
from elasticlab.alloc.policies.base import Policy


def _penalty(age, restarts, delay):
    """Pollux §4.2 re-allocation penalty max(T - R delta, 0) / (T + delta) (scalar form of
    ``elasticlab.goodput.restart_penalty``)."""
    return max(age - restarts * delay, 0.0) / (age + delay)


class GoodputPolicy(Policy):
    name = "goodput"
    batch_mode = "goodput"
    one_distributed_per_node = True

    def __init__(self, q: float = 1.0, s0: float = 3600.0, restart_delay: float = 30.0,
                 max_gpus_per_job: int = 64, min_one: bool = True):
        if q < 0 or s0 <= 0:
            raise ValueError(f"need q >= 0 and s0 > 0, got q={q}, s0={s0}")
        self.q, self.s0, self.restart_delay = float(q), float(s0), float(restart_delay)
        self.max_gpus_per_job = int(max_gpus_per_job)
        self.min_one = bool(min_one)
        self.round_times: list[float] = []

    def allocate(self, jobs, now, cluster):
        t0 = time.perf_counter()
        total = cluster.total_gpus
        jobs = sorted(jobs, key=lambda j: (j.submission_time, j.name))
        if not jobs:
            return {}
        U = np.empty((len(jobs), total + 1))
        hi = np.empty(len(jobs), dtype=np.int64)
        g = np.arange(total + 1)
        for i, job in enumerate(jobs):
            hi[i] = min(job.max_replicas(cap=self.max_gpus_per_job), total)
            s = job.speedup_curve(total, cluster.gpus_per_node, upto=hi[i])
            w = (1.0 + job.attained_service / self.s0) ** (-self.q)
            pen = _penalty(job.age(now), job.restarts, self.restart_delay)
            U[i] = w * np.where(g == job.gpus, s, s * pen)
        lo = None
        if self.min_one:
            lo = (np.arange(len(jobs)) < total).astype(np.int64)
        alloc = dp_allocate(U, total, min_gpus=lo, max_gpus=hi)
        self.round_times.append(time.perf_counter() - t0)
        return {j.name: int(a) for j, a in zip(jobs, alloc) if a > 0}
