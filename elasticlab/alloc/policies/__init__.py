"""Scheduling policies, one module each; ``get_policy(name)`` builds one by its CLI name.

A policy sees the active jobs (objects of the :class:`~.base.Job` protocol) every scheduling round and
returns GPU counts {job name: GPUs}; ``elasticlab.alloc.placement.place`` then maps counts to nodes.

:data:`POLICIES` (name -> class) is the one list of allocation policies: every :class:`Policy` subclass
with its own ``name`` defined in a module of this package is registered when the package is imported
(adding a policy is adding one module here); a policy defined elsewhere joins with :func:`register_policy`.
Each class carries what the simulator, the live cluster, the CLI and the widgets read: ``name``,
``batch_mode``, ``live`` (offered on the live cluster) and ``baseline`` (compared with the DP in the
AllocationExplorer).
"""
from __future__ import annotations

import importlib
import pkgutil

from elasticlab.alloc.policies.base import Cluster, Policy
from elasticlab.alloc.policies.fifo import FifoPolicy
from elasticlab.alloc.policies.goodput import GoodputPolicy
from elasticlab.alloc.policies.gpu_elastic import GpuElasticPolicy
from elasticlab.alloc.policies.optimus import OptimusPolicy
from elasticlab.alloc.policies.pollux import PolluxPolicy
from elasticlab.alloc.policies.saxena import SaxenaPolicy
from elasticlab.alloc.policies.tiresias import TiresiasPolicy

#: The allocation policies by name (their ``name`` attribute), in module order.
POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator (or call): add a :class:`Policy` subclass to :data:`POLICIES` under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)) or "name" not in cls.__dict__:
        raise TypeError(f"a policy is a Policy subclass with its own name, got {cls!r}")
    POLICIES[cls.name] = cls
    return cls


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "base" or info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for obj in list(vars(mod).values()):
            if (isinstance(obj, type) and issubclass(obj, Policy) and obj.__module__ == mod.__name__
                    and "name" in obj.__dict__):
                register_policy(obj)


_discover()

__all__ = ["POLICIES", "get_policy", "policy_names", "register_policy", "Policy", "Cluster", "FifoPolicy",
           "GoodputPolicy", "GpuElasticPolicy", "OptimusPolicy", "PolluxPolicy", "SaxenaPolicy",
           "TiresiasPolicy"]


def policy_names() -> list[str]:
    """The registered policy names, sorted (as the CLI and widgets show them)."""
    return sorted(POLICIES)


def get_policy(name: str, **kwargs) -> Policy:
    """A fresh policy object by name (policies keep per-run state)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {sorted(POLICIES)}") from None
    return cls(**kwargs)
