"""Pollux's scheduling objective (Qiao et al., OSDI 2021, Eq. (9) and §4.2), solved exactly by the DP.

maximise  FITNESS_p = ((1/J) sum_j SPEEDUP_j(g_j)^p)^(1/p)  over GPU counts g_j, with
* SPEEDUP_j re-based to the fair share ceil(GPUs / J) (Pollux Eq. (8) with a_f the fair share),
* the re-allocation penalty (T_j - R_j delta) / (T_j + delta) on every count other than the current one,
* the artifact's +1e-3 so that a job with no GPUs costs 1/1e-3 under p = -1,
* per-job caps: twice the largest count profiled so far (prior-driven exploration), the batch limits.
For p != 0 the power mean is monotone in sign(p) sum_j x_j^p, and for p = 0 in sum_j log x_j: the objective
is a sum over jobs, so ``dp_allocate`` finds the exact optimum on GPU counts (instead of a genetic search
over node matrices); placement on nodes follows; ``interference_avoidance=True`` allows at most one
distributed job per node (off by default: the simulator models no interference slowdown, the artifact's
default of 0.0, and our greedy placement loses GPUs to that constraint where Pollux's GA searches node
matrices).
"""
from __future__ import annotations

import math

import numpy as np

from elasticlab.alloc.dp import dp_allocate
from elasticlab.alloc.objective import restart_penalty
from elasticlab.alloc.policies.base import Policy

__all__ = ["PolluxPolicy", "power_utility"]


def power_utility(x, p: float):
    """Per-job term whose sum is monotone in the power mean of ``x`` (p = 0: log)."""
    x = np.asarray(x, dtype=float)
    if p == 0:
        return np.log(x)
    return np.sign(p) * x**p


class PolluxPolicy(Policy):
    name = "pollux"
    batch_mode = "goodput"
    live = True
    one_distributed_per_node = False

    def __init__(self, p: float = -1.0, restart_delay: float = 30.0, eps: float = 1e-3, max_gpus_per_job=64,
                 fair_share: bool = True, interference_avoidance: bool = False):
        if not math.isfinite(p):
            raise ValueError(f"p must be finite, got {p}")
        self.fair_share = bool(fair_share)
        self.one_distributed_per_node = bool(interference_avoidance)
        self.p = float(p)
        self.restart_delay = float(restart_delay)
        self.eps = float(eps)
        self.max_gpus_per_job = int(max_gpus_per_job)

    def utility_table(self, jobs, now, cluster):
        total = cluster.total_gpus
        fair = math.ceil(total / max(len(jobs), 1)) if self.fair_share else 1
        # speedups are 0 beyond max(hi, fair share), where every utility is that of 0: only the counts
        # below are computed (a row is a few dozen counts however large the cluster)
        U = np.empty((len(jobs), total + 1))
        U[:] = power_utility(np.zeros(1) + self.eps, self.p)[0]
        hi = np.empty(len(jobs), dtype=np.int64)
        for i, job in enumerate(jobs):
            hi[i] = min(job.max_replicas(cap=self.max_gpus_per_job), total)
            top = min(max(int(hi[i]), fair), total)
            s = job.speedup_curve(total, cluster.gpus_per_node, upto=top)[:top + 1]
            base = s[min(fair, total)]
            scaled = s / base / cluster.gpus_per_node if base > 0 else s
            pen = restart_penalty(job.age(now), job.restarts, self.restart_delay)
            g = np.arange(top + 1)
            scaled = np.where(g == job.gpus, scaled, scaled * pen)
            U[i, :top + 1] = power_utility(scaled + self.eps, self.p)
        return U, hi

    def allocate(self, jobs, now, cluster):
        if not jobs:
            return {}
        U, hi = self.utility_table(jobs, now, cluster)
        alloc = dp_allocate(U, cluster.total_gpus, max_gpus=hi)
        return {j.name: int(a) for j, a in zip(jobs, alloc) if a > 0}
