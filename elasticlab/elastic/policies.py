"""Batch policies: how a job's global batch is split when its world size changes.

A policy maps (world size, what the job has measured) to a :class:`BatchConfig` — the global batch
``M`` and the gradient-accumulation steps ``s`` (per-worker micro-batch ``m = ceil(M / (R (s+1)))``,
Pollux's ``M = R·m·(s+1)``) — and names the LR rule that goes with it:

* :class:`FixedGlobalBatch` — the Dynamic-SGD paper's option (a): ``M`` fixed, re-split over ``R``.
* :class:`FixedPerWorkerBatch` — option (b): ``m`` fixed so ``M = R·m``, with the Dynamic-SGD linear LR
  ramp over ``T = 8·k`` steps after a change of ``M`` by ``k`` (Lin et al. 2019).
* :class:`GoodputAdaptive` — Pollux's agent: ``(m, s) = argmax GOODPUT`` (Pollux Eq. (1)) from a
  throughput model fitted online to the job's step times and the efficiency from its GNS.

Each policy registers itself by name where it is defined (:func:`register_batch_policy`) in
:data:`POLICIES`, the one list of batch policies (read by the job panel), and says how it is sized from a
running job's batch (``for_batch(global_batch, world_size, max_batch=None)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from elasticlab.checks import number, whole


@dataclass(frozen=True)
class BatchConfig:
    """Global batch ``global_batch`` (M) taken in ``accum_steps + 1`` micro-steps per worker."""

    global_batch: int
    accum_steps: int = 0

    def __post_init__(self):
        object.__setattr__(self, "global_batch",
                           whole("global_batch", self.global_batch, 1, "a positive integer"))
        object.__setattr__(self, "accum_steps",
                           whole("accum_steps", self.accum_steps, 0, "a non-negative integer"))

    def per_worker_batch(self, world_size: int) -> int:
        return math.ceil(self.global_batch / (world_size * (self.accum_steps + 1)))


#: The batch policies by name, in registration order: name -> class.
POLICIES: dict[str, type] = {}


def register_batch_policy(name: str):
    """Class decorator: put a batch policy in :data:`POLICIES` as ``name``. The class gives ``decide``,
    ``initial_global_batch``, ``lr_rule`` and a classmethod ``for_batch(global_batch, world_size,
    max_batch=None)`` that sizes it from a running job's global batch and world size."""

    def deco(cls):
        POLICIES[name] = cls
        return cls

    return deco


def batch_policy_name(policy, default: str | None = None) -> str | None:
    """The registered name of ``policy``'s class (exact class; or of ``policy`` itself, a class), else
    ``default``."""
    kind = policy if isinstance(policy, type) else type(policy)
    return next((n for n, cls in POLICIES.items() if kind is cls), default)


def make_batch_policy(name: str, global_batch: int, world_size: int, max_batch: int | None = None):
    """A batch policy by name, sized from a job's current global batch and world size."""
    if name not in POLICIES:
        raise ValueError(f"unknown batch policy {name!r}; choose one of {tuple(POLICIES)}")
    global_batch, world_size = max(1, int(global_batch)), max(1, int(world_size))
    return POLICIES[name].for_batch(global_batch, world_size, max_batch)


def _accum_for(local: int, max_per_worker: int | None) -> int:
    return 0 if not max_per_worker else max(0, math.ceil(local / max_per_worker) - 1)


@register_batch_policy("fixed_global")
@dataclass
class FixedGlobalBatch:
    """Keep ``global_batch`` whatever the world size (Dynamic SGD option (a)); LR unchanged.

    ``max_per_worker_batch`` (a memory cap) adds accumulation steps when one worker's share is too big.
    """

    global_batch: int
    max_per_worker_batch: int | None = None
    lr_rule: str = "constant"

    def __post_init__(self):
        self.global_batch = whole("global_batch", self.global_batch, 1, "a positive integer")
        if self.max_per_worker_batch is not None:
            self.max_per_worker_batch = whole("max_per_worker_batch", self.max_per_worker_batch, 1,
                                              "a positive integer or None")

    def decide(self, world_size: int, stats: dict | None = None) -> BatchConfig:
        s = _accum_for(math.ceil(self.global_batch / world_size), self.max_per_worker_batch)
        return BatchConfig(int(self.global_batch), s)

    def initial_global_batch(self) -> int:
        return int(self.global_batch)

    @classmethod
    def for_batch(cls, global_batch: int, world_size: int, max_batch: int | None = None):
        return cls(global_batch)


@register_batch_policy("fixed_per_worker")
@dataclass
class FixedPerWorkerBatch:
    """Keep the per-worker batch; ``M = R·m`` and the LR follows the Dynamic-SGD ramp.

    Lin et al. 2019: after ``M`` changes by ``k``, the LR multiplier ramps linearly from the old to the
    new linear-scaling value over ``ramp_per_k·k`` steps (``ramp_per_k = 8``).
    """

    per_worker_batch: int
    ramp_per_k: int = 8
    lr_rule: str = "dynamic_sgd"

    def __post_init__(self):
        self.per_worker_batch = whole("per_worker_batch", self.per_worker_batch, 1, "a positive integer")
        number("ramp_per_k", self.ramp_per_k, lambda k: k >= 0, "a finite number of steps >= 0")

    def decide(self, world_size: int, stats: dict | None = None) -> BatchConfig:
        return BatchConfig(int(self.per_worker_batch) * int(world_size), 0)

    def initial_global_batch(self) -> int:
        return int(self.per_worker_batch)

    @classmethod
    def for_batch(cls, global_batch: int, world_size: int, max_batch: int | None = None):
        return cls(max(1, global_batch // world_size))


@register_batch_policy("goodput")
@dataclass
class GoodputAdaptive:
    """Pollux's batch choice: ``argmax_{m,s} THROUGHPUT(R, m, s) · EFFICIENCY(M)`` (Pollux Eq. (1)-(4)).

    ``stats`` must carry ``throughput_model`` (a fitted :mod:`elasticlab.goodput` model, or ``None`` before
    enough step times are measured) and ``gns`` (the gradient noise scale at the base batch, or ``None``).
    Until both exist the job runs at ``base_batch``. A new choice is taken only if its predicted goodput
    beats the current one by ``hysteresis`` (AdaptDL uses 1.05).
    """

    base_batch: int
    max_batch: int
    per_worker_range: tuple[int, int] = (1, 256)
    accumulation: bool = True
    hysteresis: float = 1.05
    lr_rule: str = "adascale"
    last: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.base_batch = whole("base_batch", self.base_batch, 1, "a positive integer")
        self.max_batch = whole("max_batch", self.max_batch, 1, "a positive integer")
        number("hysteresis", self.hysteresis, lambda h: h >= 1, "a finite factor >= 1")
        if self.max_batch < self.base_batch:
            raise ValueError(f"max_batch {self.max_batch!r} is below base_batch {self.base_batch!r}")
        try:
            lo, hi = (whole("per_worker_range", v, 1) for v in self.per_worker_range)
        except (TypeError, ValueError):
            lo, hi = 0, 0
        if not 1 <= lo <= hi:
            raise ValueError(f"per_worker_range must be 1 <= lo <= hi, got {self.per_worker_range!r}")

    def initial_global_batch(self) -> int:
        return int(self.base_batch)

    @classmethod
    def for_batch(cls, global_batch: int, world_size: int, max_batch: int | None = None):
        return cls(base_batch=global_batch, max_batch=int(max_batch or 16 * global_batch))

    def decide(self, world_size: int, stats: dict | None = None) -> BatchConfig:
        stats = stats or {}
        model, gns = stats.get("throughput_model"), stats.get("gns")
        current: BatchConfig | None = stats.get("current")
        fallback = BatchConfig(int(self.base_batch),
                               _accum_for(math.ceil(self.base_batch / world_size), self.per_worker_range[1]))
        if model is None or gns is None or not math.isfinite(gns):
            self.last = {"reason": "no model yet"}
            return current or fallback
        from elasticlab.goodput.agent import BatchLimits, GoodputAgent

        limits = BatchLimits(int(self.base_batch), int(self.max_batch), tuple(self.per_worker_range),
                             accumulation=self.accumulation)
        agent = GoodputAgent(limits, model, gns)
        agent.observe(world_size)  # the job has run at this size: its model is fitted to it
        cur = None if current is None else (current.per_worker_batch(world_size), current.accum_steps)
        best = agent.best_batch(world_size, 1, "goodput", cur, self.hysteresis)  # one hysteresis rule
        self.last = {"goodput": best.goodput, "per_worker_batch": best.per_gpu, "accum_steps": best.accum}
        if cur is not None:
            self.last["current_goodput"] = float(agent.function("goodput").evaluate(1, world_size, *cur))
            if (best.per_gpu, best.accum) == cur:
                return current
        return BatchConfig(max(int(self.base_batch), best.global_batch), best.accum)
