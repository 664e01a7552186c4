"""The cluster's policies: the allocation policies of :mod:`elasticlab.alloc.policies`, plus a fixed
equal-share baseline, each with the batch mode its jobs run in.

* ``goodput`` -- elasticlab's goodput-DP (goodput speedups, least-attained-service weights, restart penalty);
* ``pollux`` -- Pollux's p = -1 power mean of fair-share speedups with the restart penalty (Eq. (9), §4.2);
* ``saxena`` -- Saxena et al.'s total-throughput DP, batch chosen for throughput;
* ``fifo`` -- each job its requested slots, in submission order, batch fixed;
* ``equal_share`` -- the pool split evenly among the jobs present (re-split only when they change), batch
  fixed at M0: what a static partition of a machine gives.
"""
from __future__ import annotations

from elasticlab.alloc.policies import POLICIES as ALLOC_POLICIES
from elasticlab.alloc.policies import get_policy
from elasticlab.alloc.policies.base import Policy

#: The batch mode of each cluster policy (see :data:`elasticlab.cluster.view.BATCH_MODES`).
BATCH_MODE = {"goodput": "goodput", "pollux": "goodput", "saxena": "throughput", "fifo": "fixed",
              "equal_share": "fixed"}
#: Defaults scaled to a local cluster's seconds-long jobs (the alloc defaults are for hour-long jobs).
DEFAULT_KWARGS = {"goodput": {"s0": 60.0}}


class EqualSharePolicy(Policy):
    """``floor(slots / J)`` slots per job, the remainder one each in submission order, capped per job."""

    name = "equal_share"
    batch_mode = "fixed"

    def allocate(self, jobs, now, cluster):
        jobs = sorted(jobs, key=lambda j: (j.submission_time, j.name))[:cluster.total_gpus]
        if not jobs:
            return {}
        share, extra = divmod(cluster.total_gpus, len(jobs))
        out = {}
        for i, j in enumerate(jobs):
            out[j.name] = min(share + (1 if i < extra else 0), int(j.spec.max_slots))
        return out


def policy_names() -> list[str]:
    return sorted(BATCH_MODE)


def make_policy(name: str, **kwargs) -> Policy:
    """A fresh cluster policy by name; ``kwargs`` go to its constructor."""
    if name not in BATCH_MODE:
        raise ValueError(f"unknown cluster policy {name!r}; choose one of {policy_names()}")
    if name == "equal_share":
        return EqualSharePolicy(**kwargs)
    assert name in ALLOC_POLICIES
    return get_policy(name, **{**DEFAULT_KWARGS.get(name, {}), **kwargs})
