"""A live job as the allocation policies see it (the job protocol of :mod:`elasticlab.alloc.policies`).

:class:`LiveJob` wraps one submitted job (its :class:`~elasticlab.cluster.spec.JobSpec` and, once
started, its :class:`~elasticlab.elastic.ElasticJob`). Its :class:`~elasticlab.goodput.agent.GoodputAgent`
(the same job-side model the simulator's jobs use) holds the throughput model the job itself fitted and
published (an ``ElasticJob`` refits every ``goodput_refit_s``; a job that publishes none, such as a torchrun
job, is fitted here) and the job's live gradient noise scale. From it a policy reads ``speedup_curve``
(Pollux Eq. (8), the best batch per slot count folded in), ``max_replicas`` (Pollux's exploration limit),
``age``, ``restarts`` and ``attained_service``; the cluster applies :meth:`LiveJob.best_batch`.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.records import StepTime
from elasticlab.elastic.requests import Kind
from elasticlab.elastic.states import TERMINAL as JOB_TERMINAL
from elasticlab.elastic.states import StrEnum
from elasticlab.goodput.agent import MODES, BatchLimits, GoodputAgent

#: How a policy's jobs choose their batch on the live cluster: the agent's modes (goodput: Pollux's agent,
#: throughput: Saxena, fixed: M0) less "initial", which only the simulator's trace-driven baselines use.
BATCH_MODES = tuple(m for m in MODES if m != "initial")


class LiveState(StrEnum):
    """A live job's state on the cluster (equal to its plain-string value); the end states are its job
    handle's (:data:`elasticlab.elastic.states.TERMINAL`) and ``dropped``."""

    QUEUED = "queued"  # submitted, holds no slot
    STARTING = "starting"  # its handle is being started on the slots it holds
    RUNNING = "running"
    PAUSED = "paused"  # allocated no slot this round: checkpointed, processes warm
    FINISHED = "finished"
    FAILED = "failed"  # the job failed, or raised and made no progress for crash_grace_s
    STOPPED = "stopped"  # the cluster stopped while it ran
    DROPPED = "dropped"  # refused at admission (admission="drop")


#: A live job's end states: its elastic job's, and "dropped" (refused at admission).
TERMINAL = (*(LiveState(s.value) for s in JOB_TERMINAL), LiveState.DROPPED)


class Target(NamedTuple):
    """What the last scheduling round gave a job: slots (0: none, pause it) and the batch to run."""

    slots: int
    batch: BatchConfig | None


class InFlight(NamedTuple):
    """The one request a job has in flight: its kind, the handle's future, and what was asked
    (``n``, ``batch``, ``from_size``; reported in the cluster's events)."""

    kind: Kind
    future: Future
    info: dict


class LiveJob:
    """One job of a :class:`~elasticlab.cluster.LocalCluster` (see the module docstring)."""

    def __init__(self, spec, submission_time: float, batch_mode: str = "goodput"):
        self.spec = spec
        self.name = spec.name
        self.submission_time = float(submission_time)
        self.batch_mode = batch_mode
        self.handle = None  # the ElasticJob (or a torchrun job) once started
        self.state = LiveState.QUEUED
        self.held = 0  # slots reserved in the pool for this job
        self.num_restarts = 0  # re-allocations after the first start
        self.attained_service = 0.0  # slot-seconds
        self.start_time: float | None = None
        self.finish_time: float | None = None
        self.error: str | None = None
        self.agent = GoodputAgent(BatchLimits(int(spec.initial_batch), int(spec.max_batch),
                                              tuple(int(v) for v in spec.per_slot_batch),
                                              force_accum_single_gpu=False))
        self._fit_rows = 0
        self.pending: InFlight | None = None  # the request in flight
        self.target = Target(0, None)
        self.stopping = False  # its handle is being stopped
        self.event_index = 0
        self.last_step_t: float | None = None
        self.last_step = 0
        self.error_seen_t: float | None = None
        self._n: int | None = None
        self._counting = False
        self._metric_index = 0
        self._samples_done = 0

    # ---- what the alloc policies read (SimJob interface) -------------------------------------
    @property
    def gpus(self) -> int:
        return int(self.world_size)

    @property
    def target_replicas(self) -> int:
        return int(self.spec.slots)

    @property
    def restarts(self) -> int:
        return int(self.num_restarts)

    def age(self, now: float) -> float:
        return max(now - self.submission_time, 0.0)

    @property
    def world_size(self) -> int:
        if self.handle is None or self.state in TERMINAL or self.state == LiveState.PAUSED:
            return 0
        try:
            return int(self.handle.status()["world_size"])
        except Exception:
            return 0

    def gns(self) -> float | None:
        if self.handle is None:
            return None
        g = self.handle.status().get("gns")
        if g is None or not math.isfinite(g):
            return None
        return max(float(g), 0.0)

    @property
    def model(self):
        """The throughput model (Pollux §4.1) the job published or this view fitted; None before one."""
        return self.agent.model

    @property
    def max_profiled_replicas(self) -> int:
        return self.agent.max_profiled

    def refit(self, min_rows: int = 3, every: int = 4) -> None:
        """Bring the agent up to date: the live GNS, the most slots profiled, and the throughput model --
        the one the job published if it fits its own (so each job is fitted once), else a refit here when
        ``every`` new step times have come in (Pollux §4.1); either once ``min_rows`` step times exist."""
        if self.handle is None:
            return
        self.agent.grad_stats = self.gns()
        rows = self.handle.step_times()
        if rows:
            self.agent.observe(max(int(StepTime(*r).gpus) for r in rows))
        if getattr(self.handle, "fits_throughput", False):  # the job fits itself: use its model
            model = self.handle.throughput_model() if len(rows) >= min_rows else None
            if model is not None:
                self.agent.model = model
            return
        if len(rows) < min_rows or len(rows) - self._fit_rows < every:
            return
        # one row per configuration (median step time): robust to a busy machine's outliers
        if self.agent.fit(self.handle.step_times(aggregate=True)):
            self._fit_rows = len(rows)

    def _prior_rate(self) -> float:
        """Before a fit: the 1-slot rate measured so far, in M0-steps per second (1 when nothing ran)."""
        st = self.handle.status() if self.handle is not None else {}
        sps, ws = st.get("samples_per_s"), st.get("world_size") or 0
        return sps / ws / float(self.spec.initial_batch) if sps and ws else 1.0

    def goodput_curve(self, max_gpus: int, gpus_per_node: int = 1, mode: str | None = None,
                      upto: int | None = None) -> np.ndarray:
        """Predicted goodput (Pollux Eq. (1)) in M0-steps per second at g = 0..max_gpus slots
        (:meth:`GoodputAgent.goodput_curve`). Before the first fit: g times the rate measured so far."""
        prior = self._prior_rate() if self.agent.model is None else 1.0
        return self.agent.goodput_curve(max_gpus, gpus_per_node, mode or self.batch_mode, upto,
                                        prior_rate=prior)

    def speedup_curve(self, max_gpus: int, gpus_per_node: int = 1, mode: str | None = None,
                      upto: int | None = None) -> np.ndarray:
        """Pollux Eq. (8) (:meth:`GoodputAgent.speedup_curve`); linear before the first fit."""
        return self.agent.speedup_curve(max_gpus, gpus_per_node, mode or self.batch_mode, upto)

    def count_samples(self) -> None:
        """Build the task once in a background thread to count its samples (never blocks a round)."""
        if self._n is not None or self._counting:
            return
        self._counting = True

        def count():
            from elasticlab.elastic.task import build

            try:
                self._n = len(build(self.spec.entrypoint, self.spec.entry_kwargs))
            except Exception:
                self._n = 0  # unknown: remaining_progress falls back to the same prior for every job

        threading.Thread(target=count, name=f"count-{self.name}", daemon=True).start()

    def dataset_size(self) -> int | None:
        """Samples in the job's dataset; None until :meth:`count_samples` has counted them."""
        if self._n is None:
            self.count_samples()
        return self._n or None

    def samples_done(self) -> int:
        """Samples processed so far (from the job's per-step records)."""
        if self.handle is not None:
            new = self.handle.metrics(self._metric_index)
            self._metric_index += len(new)
            self._samples_done += sum(int(r.get("samples") or 0) for r in new)
        return self._samples_done

    def remaining_progress(self) -> float:
        """Work left in M0-steps: samples still to process (epochs x dataset, the job's declared work)
        over M0."""
        n = self.dataset_size()
        if n is None:  # not counted yet: work = epochs of a nominal 1000 samples
            n = 1000
        total = self.spec.epochs * n
        if self.spec.max_steps is not None:
            total = min(total, self.spec.max_steps * self.spec.initial_batch)
        return max(total - self.samples_done(), 0) / float(self.spec.initial_batch)

    def max_replicas(self, cap: int = 64) -> int:
        """Pollux's exploration limit (twice the most slots profiled, >= 1), within the spec's range and
        the batch limits (a slot needs at least the per-slot minimum)."""
        sp = self.spec
        lim = min(self.agent.exploration_limit(cap), sp.max_slots)
        lim = min(lim, max(self.agent.max_batch(self.batch_mode) // sp.per_slot_batch[0], 1))
        return max(int(lim), 1)

    def best_batch(self, g: int, mode: str | None = None, current: BatchConfig | None = None,
                   hysteresis: float = 1.05, nodes: int = 1) -> BatchConfig:
        """The batch to run at ``g`` slots on ``nodes`` nodes: the agent's choice
        (:meth:`GoodputAgent.best_batch`: Pollux's ``argmax_{m,s} GOODPUT`` in goodput mode, the throughput
        maximiser in throughput mode, M0 split over ``g`` in fixed mode or before a fit). Keeps ``current``
        unless the new choice is predicted ``hysteresis`` times better."""
        mode = mode or self.batch_mode
        if g < 1:
            raise ValueError(f"best_batch needs g >= 1 slots, got {g!r}")
        cur = None
        if current is not None and current.global_batch <= self.spec.max_batch:
            cur = (current.per_worker_batch(g), current.accum_steps)
        choice = self.agent.best_batch(g, nodes, mode, cur, hysteresis)
        if cur is not None and (choice.per_gpu, choice.accum) == cur:
            return current
        return BatchConfig(max(choice.global_batch, int(self.spec.initial_batch)), choice.accum)

    def predicted_goodput(self) -> float | None:
        """Goodput of the current configuration by the fitted model (M0-samples per second)."""
        if self.agent.model is None or self.handle is None or self.world_size < 1:
            return None
        st = self.handle.status()
        if not st.get("global_batch"):
            return None
        fn = self.agent.function("goodput")
        return float(fn.evaluate(1, st["world_size"], st["per_worker_batch"], st["accum_steps"]))

    def jct(self, now: float) -> float | None:
        """Job completion time (submission to finish), or the time so far while it runs."""
        if self.state == LiveState.DROPPED:
            return None
        end = self.finish_time if self.finish_time is not None else now
        return max(end - self.submission_time, 0.0)
