"""The cluster's policies: the allocation policies of :mod:`elasticlab.alloc.policies` marked ``live``,
plus a fixed equal-share baseline, each with the batch mode its jobs run in (its ``batch_mode``):

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

#: Defaults scaled to a local cluster's seconds-long jobs (the alloc defaults are for hour-long jobs).
DEFAULT_KWARGS = {"goodput": {"s0": 60.0}}


class EqualSharePolicy(Policy):
    """``floor(slots / J)`` slots per job, the remainder one each in submission order, capped per job."""

    name = "equal_share"
    batch_mode = "fixed"
    live = True

    def allocate(self, jobs, now, cluster):
        jobs = sorted(jobs, key=lambda j: (j.submission_time, j.name))[:cluster.total_gpus]
        if not jobs:
            return {}
        share, extra = divmod(cluster.total_gpus, len(jobs))
        out = {}
        for i, j in enumerate(jobs):
            out[j.name] = min(share + (1 if i < extra else 0), int(j.spec.max_slots))
        return out


def _policies() -> dict[str, type[Policy]]:
    out = {name: cls for name, cls in ALLOC_POLICIES.items() if cls.live}
    out[EqualSharePolicy.name] = EqualSharePolicy
    return out


def policy_names() -> list[str]:
    return sorted(_policies())


def batch_mode(name: str) -> str:
    """The batch mode of cluster policy ``name`` (see :data:`elasticlab.cluster.view.BATCH_MODES`)."""
    return _lookup(name).batch_mode


def __getattr__(name):  # ``BATCH_MODE``: {policy: batch mode}, read from the policies when asked
    if name == "BATCH_MODE":
        return {n: cls.batch_mode for n, cls in _policies().items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _lookup(name: str) -> type[Policy]:
    pols = _policies()
    if name not in pols:
        raise ValueError(f"unknown cluster policy {name!r}; choose one of {policy_names()}")
    return pols[name]


def make_policy(name: str, **kwargs) -> Policy:
    """A fresh cluster policy by name; ``kwargs`` go to its constructor."""
    cls = _lookup(name)
    if name not in ALLOC_POLICIES:
        return cls(**kwargs)
    return get_policy(name, **{**DEFAULT_KWARGS.get(name, {}), **kwargs})
