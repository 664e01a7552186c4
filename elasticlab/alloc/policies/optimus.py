"""Optimus-like greedy (Peng et al., EuroSys 2018) with an oracle, as Pollux's "Optimus+Oracle+TunedJobs".

Batch fixed at the user's value. Every job first gets one GPU (in submission order while GPUs last);
then GPUs go one at a time to the job whose completion-time estimate drops most,
(T_iter(k) - T_iter(k+1)) x remaining iterations, with true step times of a packed placement and the
oracle's remaining iterations at that batch.
"""
from __future__ import annotations

import heapq

from elasticlab.alloc.policies.base import Policy


def packed(k: int, gpus_per_node: int) -> tuple:
    full, rem = divmod(int(k), gpus_per_node)
    return (gpus_per_node,) * full + ((rem,) if rem else ())


class OptimusPolicy(Policy):
    name = "optimus"
    batch_mode = "fixed"

    def _iter_time(self, job, k, gpn):
        b, s = job.app.batch_split(job.target_batch, k)
        return job.app.iteration_time(packed(k, gpn), b, s)

    def allocate(self, jobs, now, cluster):
        gpn = cluster.gpus_per_node
        free = cluster.total_gpus
        out = {}
        order = sorted(jobs, key=lambda j: (j.submission_time, j.name))
        for job in order:
            if free == 0:
                break
            out[job.name] = 1
            free -= 1
        by_name = {j.name: j for j in jobs}
        remaining = {n: by_name[n].remaining_iterations() for n in out}
        cap = {n: min(cluster.total_gpus, max(by_name[n].target_batch // by_name[n].app.min_local_bsz, 1))
               for n in out}
        heap = []

        def push(n):
            k = out[n]
            if k + 1 > cap[n]:
                return
            j = by_name[n]
            gain = (self._iter_time(j, k, gpn) - self._iter_time(j, k + 1, gpn)) * remaining[n]
            if gain > 0:
                heapq.heappush(heap, (-gain, n))

        for n in out:
            push(n)
        while free > 0 and heap:
            _, n = heapq.heappop(heap)
            out[n] += 1
            free -= 1
            push(n)
        return out
    baseline = True
