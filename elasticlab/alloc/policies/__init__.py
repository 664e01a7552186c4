"""Scheduling policies, one module each; ``get_policy(name)`` builds one by its CLI name.

A policy sees the active jobs (``elasticlab.sim.job.SimJob``-like objects) every scheduling round and
returns GPU counts {job name: GPUs}; ``elasticlab.alloc.placement.place`` then maps counts to nodes.
"""
from __future__ import annotations

from elasticlab.alloc.policies.base import Cluster, Policy
from elasticlab.alloc.policies.fifo import FifoPolicy
from elasticlab.alloc.policies.goodput import GoodputPolicy
from elasticlab.alloc.policies.gpu_elastic import GpuElasticPolicy
from elasticlab.alloc.policies.optimus import OptimusPolicy
from elasticlab.alloc.policies.pollux import PolluxPolicy
from elasticlab.alloc.policies.saxena import SaxenaPolicy
from elasticlab.alloc.policies.tiresias import TiresiasPolicy

POLICIES = {
    "fifo": FifoPolicy,
    "tiresias": TiresiasPolicy,
    "optimus": OptimusPolicy,
    "gpu-elastic": GpuElasticPolicy,
    "saxena": SaxenaPolicy,
    "pollux": PolluxPolicy,
    "goodput": GoodputPolicy,
}

__all__ = ["POLICIES", "get_policy", "Policy", "Cluster"] + [c.__name__ for c in POLICIES.values()]


def get_policy(name: str, **kwargs) -> Policy:
    """A fresh policy object by name (policies keep per-run state)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}") from None
    return cls(**kwargs)
