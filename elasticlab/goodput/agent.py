"""One job's side of Pollux (Qiao et al., OSDI 2021, §4.1): the agent that owns the job's throughput fit and
gradient statistics, chooses its batch, and publishes the goodput and speedup curves the scheduler reads.

The simulator's job (:class:`elasticlab.sim.job.SimJob`), the live cluster's view of a running job
(:class:`elasticlab.cluster.view.LiveJob`) and the elastic job's goodput-adaptive batch policy
(:class:`elasticlab.elastic.policies.GoodputAdaptive`) each hold one :class:`GoodputAgent` and differ only in
where its inputs come from (replayed traces, a running job's published fit and GNS).

``mode`` everywhere: ``"goodput"`` (Pollux's agent: batch re-optimised for goodput, Eq. (1)),
``"throughput"`` (the largest-throughput batch, efficiency ignored: phi = inf, Saxena's objective),
``"fixed"`` (a given global batch split over the GPUs), ``"initial"`` (M0 split over the GPUs).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from elasticlab.goodput.fit import fit_throughput_model
from elasticlab.goodput.function import GoodputFunction

__all__ = ["BatchLimits", "BatchChoice", "GoodputAgent", "MODES"]

#: How a job picks its batch (see the module docstring).
MODES = ("goodput", "throughput", "fixed", "initial")


@dataclass(frozen=True)
class BatchLimits:
    """What a job allows: ``init`` = M0 (the batch its LR was tuned for), ``max`` the largest global batch,
    ``local`` the per-GPU micro-batch range (memory), ``accumulation`` whether gradient accumulation may be
    used, ``force_accum_single_gpu`` Pollux's rule that one GPU
    above M0 takes >= 2 micro-batches (its GNS needs two)."""

    init: int
    max: int
    local: tuple[int, int] = (1, 1 << 30)
    force_accum_single_gpu: bool = True
    accumulation: bool = True

    def __post_init__(self):
        if not 1 <= self.init <= self.max:
            raise ValueError(f"need 1 <= init batch <= max batch, got init={self.init!r}, max={self.max!r}")
        lo, hi = self.local
        if not 1 <= lo <= hi:
            raise ValueError(f"per-GPU batch range must be 1 <= lo <= hi, got {self.local!r}")

    def split(self, batch: int, gpus: int) -> tuple[int, int]:
        """``batch`` over ``gpus`` with the fewest accumulation steps the per-GPU maximum allows:
        ``(per-GPU batch b, accumulation steps s)`` with ``gpus * b * (s + 1) >= batch``."""
        local = math.ceil(int(batch) / max(int(gpus), 1))
        s = max(0, math.ceil(local / self.local[1]) - 1)
        return math.ceil(local / (s + 1)), s


class BatchChoice(NamedTuple):
    """A batch for ``gpus`` GPUs: per-GPU micro-batch, accumulation steps, predicted goodput (M0-samples/s,
    0 when not predicted) and the global batch (``gpus * per_gpu * (accum + 1)`` for the agent's choice; for a
    split of a given batch, that batch, which each GPU's rounded-up share may exceed)."""

    per_gpu: int
    accum: int
    goodput: float
    global_batch: int


class GoodputAgent:
    """Pollux's per-job agent (§4.1): throughput model + gradient statistics -> batch choice and curves.

    ``model`` a fitted :class:`~elasticlab.goodput.ThroughputModel` (None until one is fitted);
    ``grad_stats`` phi, ``(sqr, var)`` or a GNS object (None until measured: no batch adaptation then);
    ``split(batch, gpus) -> (b, s)`` how a fixed batch is split (default :meth:`BatchLimits.split`).
    ``max_profiled`` the most GPUs the job has run on (Pollux's exploration: curves are linear before it
    has run, and it may grow to at most twice that).
    """

    def __init__(self, limits: BatchLimits, model=None, grad_stats=None,
                 split: Callable[[int, int], tuple[int, int]] | None = None):
        self.limits = limits
        self.model = model
        self.grad_stats = grad_stats
        self.split = split or limits.split
        self.max_profiled = 0
        self._fn = (None, None, None, None)  # (model, limits, statistics, GoodputFunction): see function()

    # ---- inputs ---------------------------------------------------------------------------------------
    def observe(self, gpus: int) -> None:
        """The job has run on ``gpus`` GPUs."""
        self.max_profiled = max(self.max_profiled, int(gpus))

    def fit(self, rows) -> bool:
        """Fit the throughput model to step-time rows (Pollux §4.1; :func:`fit_throughput_model`); keep the
        previous fit when these rows cannot identify one. True when the model changed."""
        try:
            self.model = fit_throughput_model(rows)
        except (ValueError, RuntimeError, FloatingPointError):
            return False
        return True

    def max_batch(self, mode: str) -> int:
        """The largest global batch ``mode`` may choose: M0 for fixed batches and before the GNS is known
        (no batch adaptation without it)."""
        if mode in ("fixed", "initial") or (mode == "goodput" and self.grad_stats is None):
            return int(self.limits.init)
        return int(self.limits.max)

    def function(self, mode: str = "goodput") -> GoodputFunction | None:
        """Pollux Eq. (1) for this job (phi = inf in throughput mode); None before a throughput fit."""
        if self.model is None:
            return None
        stats = math.inf if mode == "throughput" else self.grad_stats
        stats = 0.0 if stats is None else stats
        # kept for the same inputs (the simulator asks several times per input, and building one checks
        # them): only plain statistics (a float, a pair of floats) are compared; an estimator may change
        plain = type(stats) is float or (type(stats) is tuple and len(stats) == 2 and type(stats[0]) is float
                                         and type(stats[1]) is float)
        if plain:
            model, limits, kept, fn = self._fn
            if model is self.model and limits is self.limits and type(kept) is type(stats) and kept == stats:
                return fn
        fn = GoodputFunction(self.model, stats, self.limits.init)
        if plain:
            self._fn = (self.model, self.limits, stats, fn)
        return fn

    # ---- the agent's choice ---------------------------------------------------------------------------
    def optimize(self, nodes, gpus, mode: str = "goodput"):
        """``argmax_{b,s} GOODPUT`` per allocation (Pollux §4.1): arrays ``(goodput, b, s)``."""
        lim = self.limits
        return self.function(mode).optimize(
            nodes, gpus, max_batch=self.max_batch(mode), min_per_gpu_batch=lim.local[0],
            max_per_gpu_batch=lim.local[1], accumulation=lim.accumulation,
            force_accum_single_gpu=lim.force_accum_single_gpu)

    def best_batch(self, gpus: int, nodes: int = 1, mode: str = "goodput", current=None,
                   hysteresis: float = 1.0, fixed_batch: int | None = None) -> BatchChoice:
        """The batch to run on ``gpus`` GPUs over ``nodes`` nodes: Pollux's choice in goodput / throughput
        mode once the job has run and a model is fitted; else a split of ``fixed_batch`` (fixed mode), or
        of M0 (at least the per-GPU minimum on each GPU in goodput / throughput mode). ``current`` ``(b, s)``
        is kept unless the new choice is predicted ``hysteresis`` times better (AdaptDL uses 1.05)."""
        gpus = int(gpus)
        if gpus < 1:
            raise ValueError(f"best_batch needs gpus >= 1, got {gpus!r}")
        if mode in ("goodput", "throughput") and self.model is not None and self.max_profiled > 0:
            choice = self.choice_of(gpus, mode, *self.optimize(nodes, gpus, mode))
            if choice is not None:
                b, s = choice.per_gpu, choice.accum
                if current is not None:
                    fn = self.function(mode)
                    new = float(fn.evaluate(nodes, gpus, b, s))
                    now = float(fn.evaluate(nodes, gpus, int(current[0]), int(current[1])))
                    if now > 0 and new < hysteresis * now:
                        return BatchChoice(int(current[0]), int(current[1]), now,
                                           gpus * int(current[0]) * (int(current[1]) + 1))
                return choice
        batch = self._fixed_batch(mode, gpus, fixed_batch)
        b, s = self.split(batch, gpus)
        return BatchChoice(int(b), int(s), 0.0, int(batch))

    def choice_of(self, gpus: int, mode: str, good, b, s) -> BatchChoice | None:
        """:meth:`optimize`'s ``(goodput, b, s)`` for ``gpus`` GPUs as a :class:`BatchChoice`, ``b`` held to
        :meth:`max_batch`; None where it found no feasible batch (the caller falls back)."""
        b, s, good = int(b), int(s), float(good)
        if b <= 0 or good <= 0:
            return None
        b = max(min(b, self.max_batch(mode) // (gpus * (s + 1))), 1)
        return BatchChoice(b, s, good, gpus * b * (s + 1))

    def _fixed_batch(self, mode: str, gpus: int, fixed: int | None = None) -> int:
        if mode == "fixed" and fixed is not None:
            return int(fixed)
        if mode in ("goodput", "throughput"):  # before a fit: M0, at least the per-GPU minimum on each
            return max(int(self.limits.init), self.limits.local[0] * gpus)
        return int(self.limits.init)

    # ---- what the scheduler reads ---------------------------------------------------------------------
    def goodput_curve(self, max_gpus: int, gpus_per_node: int, mode: str = "goodput", upto: int | None = None,
                      fixed_batch: int | None = None, prior_rate: float = 1.0) -> np.ndarray:
        """Predicted goodput in M0-steps per second (progress rate) at g = 0..max_gpus GPUs on
        ceil(g / gpus_per_node) nodes, best batch per g (fixed / initial: ``fixed_batch`` or M0 split over g,
        0 where the split falls below M0 or the per-GPU minimum). Before the job has run (or before a fit):
        g times its 1-GPU rate (predicted, else ``prior_rate``). Only g <= ``upto`` is evaluated."""
        out = np.zeros(max_gpus + 1)
        top = max_gpus if upto is None else max(min(int(upto), max_gpus), 0)
        if top < 1:
            return out
        m0 = float(self.limits.init)
        if self.model is None:
            out[1:top + 1] = np.arange(1, top + 1) * prior_rate
            return out
        linear = self.max_profiled == 0
        gg = np.arange(1, (1 if linear else top) + 1)
        nodes = np.ceil(gg / gpus_per_node)
        with np.errstate(divide="ignore", invalid="ignore"):
            if mode in ("goodput", "throughput"):
                good, _, _ = self.optimize(nodes, gg, mode)
            else:
                batch = fixed_batch if mode == "fixed" and fixed_batch is not None else self.limits.init
                split = np.array([self.split(batch, int(k)) for k in gg])
                good = self.function(mode).evaluate(nodes, gg, split[:, 0], split[:, 1])
                ok = (split[:, 0] * gg * (split[:, 1] + 1) >= m0) & (split[:, 0] >= self.limits.local[0])
                good = np.where(ok, good, 0.0)
        good = np.asarray(good, dtype=float)
        if linear:
            out[1:top + 1] = np.arange(1, top + 1) * good[0]
        else:
            out[1:top + 1] = good
        return np.nan_to_num(out / m0, nan=0.0, posinf=0.0)

    def speedup_curve(self, max_gpus: int, gpus_per_node: int, mode: str = "goodput", upto: int | None = None,
                      fixed_batch: int | None = None) -> np.ndarray:
        """:meth:`goodput_curve` over its 1-GPU value (Pollux Eq. (8)); g itself before the job has run or
        been fitted. Only g <= ``upto`` is evaluated (the rest is 0)."""
        top = max_gpus if upto is None else max(min(int(upto), max_gpus), 0)
        if self.model is not None and self.max_profiled > 0:
            good = self.goodput_curve(max_gpus, gpus_per_node, mode, upto, fixed_batch)
            if good[1] > 0:
                return good / good[1]
        out = np.zeros(max_gpus + 1)
        out[1:top + 1] = np.arange(1, top + 1)
        return out

    def exploration_limit(self, cap: int) -> int:
        """Pollux's exploration: at most twice the most GPUs profiled so far (>= 1), within ``cap``."""
        return max(min(max(2 * self.max_profiled, 1), int(cap)), 1)
