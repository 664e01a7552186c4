"""What a user submits to a :class:`~elasticlab.cluster.LocalCluster`: a :class:`JobSpec`.

A job names an :class:`~elasticlab.elastic.ElasticJob` entrypoint, the slots it may run on
(``min_slots..max_slots``; ``slots``, default ``min_slots``, is what it asks for under FIFO), and its
batch-size range: the initial global batch ``M0`` (what its LR was tuned for), the largest global batch
``max_batch`` and the per-slot range (a memory cap) -- Saxena et al.'s ``[b_min, b_max]`` and Pollux's
``M0, M_max, m_max``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from elasticlab.checks import whole
from elasticlab.elastic.scaling import lr_rules

#: ``pool``: an ElasticJob (worker pool re-forming gloo groups); ``torchrun``: one torchrun agent per slot.
BACKENDS = ("pool", "torchrun")


def _pos_int(name: str, v, minimum: int = 1) -> int:
    return whole(name, v, minimum, f"an integer >= {minimum}")


@dataclass
class JobSpec:
    """One job for the cluster (see the module docstring). ``work``: ``epochs`` (samples to process, the
    same under every policy -- P1's premise) or ``max_steps``. ``warm``: worker processes started ahead
    (default ``max_slots``), so that growing the job does not wait for a process to import torch.
    ``backend``: ``"pool"`` or ``"torchrun"`` (see :mod:`elasticlab.cluster.torchrun`; fixed batch)."""

    entrypoint: object
    name: str | None = None
    entry_kwargs: dict = field(default_factory=dict)
    initial_batch: int = 32
    max_batch: int | None = None
    per_slot_batch: tuple[int, int] = (1, 256)
    min_slots: int = 1
    max_slots: int | None = None
    slots: int | None = None
    epochs: int = 1
    max_steps: int | None = None
    lr_rule: str = "adascale"
    warm: int | None = None
    checkpoint_every: int = 20
    record_samples: bool | str = False
    seed: int = 0
    timeout_s: float = 30.0
    backend: str = "pool"

    @classmethod
    def of(cls, spec=None, **fields) -> JobSpec:
        """``spec`` if it is a JobSpec (no ``fields`` then), else a JobSpec of ``fields`` with ``spec`` as
        its entrypoint; the entrypoint normalised to ``"module_or_path:function"``."""
        if not isinstance(spec, cls):
            if spec is not None:
                fields.setdefault("entrypoint", spec)
            if "entrypoint" not in fields:
                raise ValueError("submit needs a JobSpec or an entrypoint")
            spec = cls(**fields)
        elif fields:
            raise ValueError("give a JobSpec or keyword fields, not both")
        from elasticlab.elastic.task import entrypoint_name

        spec.entrypoint = entrypoint_name(spec.entrypoint)
        return spec

    def free_name(self, taken) -> str:
        """``<function>-<k>``, the first k not in ``taken``."""
        base, k = self.entrypoint.rsplit(":", 1)[-1], 1
        while f"{base}-{k}" in taken:
            k += 1
        return f"{base}-{k}"

    def validate(self, pool: int) -> JobSpec:
        """Check the spec against a pool of ``pool`` slots and fill defaults; ValueError names a bad value."""
        if self.backend not in BACKENDS:
            raise ValueError(f"job {self.name!r}: backend must be one of {BACKENDS}, got {self.backend!r}")
        self.initial_batch = _pos_int("initial_batch", self.initial_batch)
        if self.max_batch is None:
            self.max_batch = self.initial_batch
        self.max_batch = _pos_int("max_batch", self.max_batch)
        if self.max_batch < self.initial_batch:
            raise ValueError(f"job {self.name!r}: max_batch={self.max_batch} is below initial_batch="
                             f"{self.initial_batch}")
        lo, hi = self.per_slot_batch
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"job {self.name!r}: per_slot_batch must be integers 1 <= lo <= hi, "
                             f"got {self.per_slot_batch!r}")
        self.min_slots = _pos_int("min_slots", self.min_slots)
        if self.min_slots > pool:
            raise ValueError(f"job {self.name!r} needs min_slots={self.min_slots} but the pool has only "
                             f"{pool} slots")
        if self.max_slots is None:
            self.max_slots = pool
        self.max_slots = _pos_int("max_slots", self.max_slots)
        if self.max_slots < self.min_slots:
            raise ValueError(f"job {self.name!r}: max_slots={self.max_slots} is below "
                             f"min_slots={self.min_slots}")
        self.max_slots = min(self.max_slots, pool)
        self.slots = self.min_slots if self.slots is None else _pos_int("slots", self.slots)
        if not self.min_slots <= self.slots <= self.max_slots:
            raise ValueError(f"job {self.name!r}: slots={self.slots} is outside [{self.min_slots}, "
                             f"{self.max_slots}]")
        if self.min_slots * lo > self.max_batch:
            raise ValueError(f"job {self.name!r}: min_slots={self.min_slots} x per-slot minimum {lo} exceeds "
                             f"max_batch={self.max_batch}")
        self.epochs = _pos_int("epochs", self.epochs)
        if self.max_steps is not None:
            self.max_steps = _pos_int("max_steps", self.max_steps)
        if self.lr_rule not in lr_rules():
            raise ValueError(f"job {self.name!r}: unknown lr_rule {self.lr_rule!r}; "
                             f"choose one of {lr_rules()}")
        self.warm = self.max_slots if self.warm is None else _pos_int("warm", self.warm)
        self.warm = max(min(self.warm, self.max_slots), self.min_slots)
        return self
