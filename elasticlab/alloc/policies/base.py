"""What every policy shares: the cluster shape and the allocate() contract."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["Cluster", "Policy", "Job"]


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
    num_nodes: int = 16
    gpus_per_node: int = 4

    def __post_init__(self):
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster needs >= 1 node and >= 1 GPU per node, got {self.num_nodes}x"
                             f"{self.gpus_per_node}")

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @classmethod
    def parse(cls, spec: str) -> Cluster:
        """'16x4' -> 16 nodes of 4 GPUs."""
        try:
            n, g = (int(x) for x in str(spec).lower().split("x"))
        except ValueError:
            raise ValueError(f"cluster must look like NODESxGPUS (e.g. 16x4), got {spec!r}") from None
        return cls(n, g)


class Policy:
    """Base class. ``batch_mode`` says how its jobs pick their batch (see ``SimJob``); ``gang`` policies
    need a job's whole count placed or nothing; ``one_distributed_per_node`` is Pollux's interference
    avoidance; ``live`` policies are offered on the live cluster (:mod:`elasticlab.cluster`)."""

    name = "base"
    batch_mode = "fixed"
    live = False
    gang = False
    one_distributed_per_node = False

    def allocate(self, jobs: list[Job], now: float, cluster: Cluster) -> dict:  # pragma: no cover
        raise NotImplementedError

    def placement_order(self, jobs):
        """Priority for placing new jobs (default: larger counts first)."""
        return None
