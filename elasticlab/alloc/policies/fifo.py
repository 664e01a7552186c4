"""Fixed-allocation FIFO: each job gets the user's GPU count, strictly in submission order, until it ends."""
from __future__ import annotations

from elasticlab.alloc.policies.base import Policy


class FifoPolicy(Policy):
    name = "fifo"
    batch_mode = "fixed"
    live = True
    gang = True

    def allocate(self, jobs, now, cluster):
        free = cluster.total_gpus
        out = {}
        for job in sorted(jobs, key=lambda j: (j.submission_time, j.name)):
            need = min(int(job.target_replicas), cluster.total_gpus)
            if need > free:
                break  # head-of-line blocking: no job overtakes an earlier one
            out[job.name] = need
            free -= need
        return out

    def placement_order(self, jobs):
        return [j.name for j in sorted(jobs, key=lambda j: (j.submission_time, j.name))]
    baseline = True
