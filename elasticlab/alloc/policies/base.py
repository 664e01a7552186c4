"""What every policy shares: the cluster shape and the allocate() contract."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from elasticlab.checks import whole

__all__ = ["Cluster", "Policy", "Job", "check_allocation"]


@runtime_checkable
class Job(Protocol):
    """How every policy sees a job (the simulator's ``SimJob`` and the live cluster's ``LiveJob`` both are
    one; their curves come from the job's :class:`elasticlab.goodput.agent.GoodputAgent`).

    The trace-driven baselines that need the job's true model (optimus: ``app``, ``target_batch``,
    ``remaining_iterations``; tiresias) are simulator-only (``live = False``)."""

    name: str
    submission_time: float
    batch_mode: str
    attained_service: float  # GPU-seconds so far

    @property
    def gpus(self) -> int: ...  # GPUs held now

    @property
    def target_replicas(self) -> int | None: ...  # the count the user asked for

    @property
    def restarts(self) -> int: ...

    def age(self, now: float) -> float: ...

    def max_replicas(self, cap: int = 64) -> int: ...  # Pollux's exploration limit within the job's range

    def remaining_progress(self) -> float: ...  # work left, in M0-steps

    def goodput_curve(self, max_gpus: int, gpus_per_node: int, mode: str | None = None,
                      upto: int | None = None) -> np.ndarray: ...  # M0-steps/s at g = 0..max_gpus

    def speedup_curve(self, max_gpus: int, gpus_per_node: int, mode: str | None = None,
                      upto: int | None = None) -> np.ndarray: ...  # Pollux Eq. (8)


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` nodes of ``gpus_per_node`` GPUs. ``capacity``: the GPUs usable, when fewer than all
    (e.g. 6 GPUs in 4-GPU nodes: ``Cluster.of_capacity(6, 4)``, nodes of 4 and 2); the nodes are filled in
    order (:attr:`node_sizes`). Every policy keeps its counts within :attr:`total_gpus`."""

    num_nodes: int = 16
    gpus_per_node: int = 4
    capacity: int | None = None

    def __post_init__(self):
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster needs >= 1 node and >= 1 GPU per node, got {self.num_nodes}x"
                             f"{self.gpus_per_node}")
        if self.capacity is not None:
            full = self.num_nodes * self.gpus_per_node
            if isinstance(self.capacity, bool) or int(self.capacity) != self.capacity \
                    or not 1 <= self.capacity <= full:
                raise ValueError(f"capacity must be a whole number of GPUs in [1, {full}] for a "
                                 f"{self.num_nodes}x{self.gpus_per_node} cluster, got {self.capacity!r}")
            object.__setattr__(self, "capacity", None if int(self.capacity) == full else int(self.capacity))

    @classmethod
    def of_capacity(cls, capacity: int, gpus_per_node: int = 4) -> Cluster:
        """The smallest cluster of ``gpus_per_node``-GPU nodes holding ``capacity`` GPUs, the last node
        partly usable when ``capacity`` is not a multiple of the node size."""
        capacity = whole("capacity", capacity, 1, "a whole number of GPUs >= 1")
        gpus_per_node = whole("gpus_per_node", gpus_per_node, 1)
        return cls(-(-capacity // gpus_per_node), gpus_per_node, capacity)

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node if self.capacity is None else self.capacity

    @property
    def node_sizes(self) -> tuple:
        """Usable GPUs per node (all ``gpus_per_node`` but at the end when ``capacity`` is set)."""
        left, out = self.total_gpus, []
        for _ in range(self.num_nodes):
            out.append(min(self.gpus_per_node, left))
            left -= out[-1]
        return tuple(out)

    @classmethod
    def parse(cls, spec: str) -> Cluster:
        """'16x4' -> 16 nodes of 4 GPUs."""
        try:
            n, g = (int(x) for x in str(spec).lower().split("x"))
        except ValueError:
            raise ValueError(f"cluster must look like NODESxGPUS (e.g. 16x4), got {spec!r}") from None
        return cls(n, g)


def check_allocation(counts: dict, cluster: Cluster, who: str = "policy") -> dict:
    """``counts`` {job: GPUs} when every count is a whole number >= 0 and they sum to at most the cluster's
    :attr:`~Cluster.total_gpus`; otherwise a ValueError naming the policy, the job or the total."""
    total = 0
    for name, c in counts.items():
        if isinstance(c, bool) or int(c) != c or c < 0:
            raise ValueError(f"{who} gave job {name!r} {c!r} GPUs; counts must be whole numbers >= 0")
        total += int(c)
    if total > cluster.total_gpus:
        raise ValueError(f"{who} allocated {total} GPUs ({dict(counts)}) but the cluster has "
                         f"{cluster.total_gpus}")
    return counts


def _checked(allocate):
    @functools.wraps(allocate)
    def wrapper(self, jobs, now, cluster):
        return check_allocation(allocate(self, jobs, now, cluster), cluster, f"policy {self.name!r}")

    wrapper._capacity_checked = True
    return wrapper


class Policy:
    """Base class. ``batch_mode`` says how its jobs pick their batch (see ``SimJob``); ``gang`` policies
    need a job's whole count placed or nothing; ``one_distributed_per_node`` is Pollux's interference
    avoidance; ``live`` policies are offered on the live cluster (:mod:`elasticlab.cluster`);
    ``baseline`` policies are the ones the AllocationExplorer (:mod:`elasticlab.widgets.allocation`) draws
    next to its exact DP.

    Every subclass's ``allocate`` is checked on return (:func:`check_allocation`): a policy that hands out
    more GPUs than ``cluster.total_gpus`` is a ValueError, never an over-full cluster."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("allocate")
        if fn is not None and not getattr(fn, "_capacity_checked", False):
            cls.allocate = _checked(fn)

    name = "base"
    batch_mode = "fixed"
    live = False
    baseline = False
    gang = False
    one_distributed_per_node = False

    def allocate(self, jobs: list[Job], now: float, cluster: Cluster) -> dict:  # pragma: no cover
        raise NotImplementedError

    def placement_order(self, jobs):
        """Priority for placing new jobs (default: larger counts first)."""
        return None
