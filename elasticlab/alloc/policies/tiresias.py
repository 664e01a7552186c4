"""Tiresias-like discretised two-queue least-attained-service (Gu et al., NSDI 2019; Pollux's baseline).

New jobs enter queue 0; a job whose attained service (running wall time x requested GPUs) reaches
``threshold`` GPU-seconds (16 GPU-hours, as in the Pollux artifact) is demoted to the end of queue 1.
Each round, jobs are admitted in queue order (FIFO within a queue) while their fixed GPU count fits,
skipping those that do not (preemptive; no starvation promotion). Batch and GPU count are the user's.
"""
from __future__ import annotations

from elasticlab.alloc.policies.base import Policy


class TiresiasPolicy(Policy):
    name = "tiresias"
    batch_mode = "fixed"
    gang = True

    def __init__(self, threshold: float = 16 * 3600.0):
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0 GPU-seconds, got {threshold}")
        self.threshold = float(threshold)
        self.queues: tuple[list, list] = ([], [])
        self.executed: dict = {}
        self.last_check: dict = {}
        self.running: set = set()

    def allocate(self, jobs, now, cluster):
        names = {j.name for j in jobs}
        by_name = {j.name: j for j in jobs}
        for q in self.queues:
            q[:] = [n for n in q if n in names]
        for j in sorted(jobs, key=lambda j: (j.submission_time, j.name)):
            if j.name not in self.executed:
                self.executed[j.name] = 0.0
                self.last_check[j.name] = now
                self.queues[0].append(j.name)
        for name in list(self.queues[0]):
            if name in self.running:
                self.executed[name] += now - self.last_check[name]
            self.last_check[name] = now
            if self.executed[name] * by_name[name].target_replicas >= self.threshold:
                self.queues[0].remove(name)
                self.queues[1].append(name)
        for name in self.queues[1]:
            if name in self.running:
                self.executed[name] += now - self.last_check[name]
            self.last_check[name] = now
        free = cluster.total_gpus
        out = {}
        for q in self.queues:
            for name in q:
                need = min(int(by_name[name].target_replicas), cluster.total_gpus)
                if need <= free:
                    out[name] = need
                    free -= need
        self.running = set(out)
        return out

    def placement_order(self, jobs):
        return list(self.queues[0]) + list(self.queues[1])
    baseline = True
