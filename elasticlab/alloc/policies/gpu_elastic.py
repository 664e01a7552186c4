"""GPU-only elastic autoscaler (Saxena et al.'s baseline): the same total-throughput DP, batch fixed.

Jobs are admitted in submission order while each can get at least one GPU (the rest wait, FIFO); the DP
then maximises the sum of admitted jobs' throughput speedups at their fixed batch size.
"""
from __future__ import annotations

import numpy as np

from elasticlab.alloc.dp import dp_allocate
from elasticlab.alloc.policies.base import Policy


class ThroughputDPPolicy(Policy):
    """Shared by gpu-elastic (fixed batch) and saxena (batch in range): sum of speedups, >= 1 GPU each."""

    batch_mode = "fixed"

    def __init__(self, max_gpus_per_job: int = 64):
        self.max_gpus_per_job = int(max_gpus_per_job)

    def allocate(self, jobs, now, cluster):
        total = cluster.total_gpus
        admitted = sorted(jobs, key=lambda j: (j.submission_time, j.name))[:total]
        if not admitted:
            return {}
        U = np.empty((len(admitted), total + 1))
        hi = np.empty(len(admitted), dtype=np.int64)
        for i, job in enumerate(admitted):
            hi[i] = min(job.max_replicas(cap=self.max_gpus_per_job), total)
            U[i] = job.speedup_curve(total, cluster.gpus_per_node, mode=self.batch_mode, upto=hi[i])
        alloc = dp_allocate(U, total, min_gpus=1, max_gpus=hi)
        return {j.name: int(a) for j, a in zip(admitted, alloc) if a > 0}


class GpuElasticPolicy(ThroughputDPPolicy):
    name = "gpu-elastic"
    batch_mode = "fixed"
    baseline = True
