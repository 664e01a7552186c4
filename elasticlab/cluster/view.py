"""A live job as the allocation policies see it: the ``SimJob`` interface of :mod:`elasticlab.alloc`.

:class:`LiveJob` wraps one submitted job (its :class:`~elasticlab.cluster.spec.JobSpec` and, once
started, its :class:`~elasticlab.elastic.ElasticJob`). It fits Pollux's throughput model to the job's
measured step times (:func:`elasticlab.goodput.fit_throughput_model`, Pollux §4.1), reads the job's live
gradient noise scale, and from both gives what a policy asks for: ``speedup_curve`` (Pollux Eq. (8), the
best batch per slot count folded in), ``max_replicas`` (Pollux's exploration limit), ``age``,
``restarts`` and ``attained_service``; and what the cluster applies, :meth:`LiveJob.best_batch`.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.states import TERMINAL as JOB_TERMINAL

#: How a policy's jobs choose their batch: goodput (Pollux agent), throughput (Saxena), fixed (M0).
BATCH_MODES = ("goodput", "throughput", "fixed")
#: A live job's end states: its elastic job's, and "dropped" (refused at admission).
TERMINAL = (*JOB_TERMINAL, "dropped")


class LiveJob:
    """One job of a :class:`~elasticlab.cluster.LocalCluster` (see the module docstring)."""

    def __init__(self, spec, submission_time: float, batch_mode: str = "goodput"):
        self.spec = spec
        self.name = spec.name
        self.submission_time = float(submission_time)
        self.batch_mode = batch_mode
        self.handle = None  # the ElasticJob (or a torchrun job) once started
        self.state = "queued"
        self.held = 0  # slots reserved in the pool for this job
        self.num_restarts = 0  # re-allocations after the first start
        self.attained_service = 0.0  # slot-seconds
        self.start_time: float | None = None
        self.finish_time: float | None = None
        self.error: str | None = None
        self.model = None  # fitted ThroughputModel
        self._fit_rows = 0
        self.max_profiled_replicas = 0
        self.pending = None  # (kind, future, info) of the request in flight
        self.target: tuple[int, BatchConfig | None] = (0, None)
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
        if self.handle is None or self.state in TERMINAL or self.state == "paused":
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

    def refit(self, min_rows: int = 3, every: int = 4) -> None:
        """Refit the throughput model when ``every`` new step times have come in (Pollux §4.1)."""
        if self.handle is None:
            return
        rows = self.handle.step_times()
        if rows:
            self.max_profiled_replicas = max(self.max_profiled_replicas, max(int(r[1]) for r in rows))
        if len(rows) < min_rows or len(rows) - self._fit_rows < every:
            return
        from elasticlab.goodput import fit_throughput_model

        try:  # one row per configuration (median step time): robust to a busy machine's outliers
            self.model = fit_throughput_model(self.handle.step_times(aggregate=True))
            self._fit_rows = len(rows)
        except (ValueError, RuntimeError, FloatingPointError):
            pass  # keep the previous fit

    def goodput_function(self, mode: str | None = None):
        """Pollux Eq. (1) for this job: the fitted throughput model and the live GNS (phi = inf in
        throughput mode: Saxena's objective ignores statistical efficiency). None before a fit."""
        if self.model is None:
            return None
        from elasticlab.goodput import GoodputFunction

        mode = mode or self.batch_mode
        phi = math.inf if mode == "throughput" else self.gns()
        return GoodputFunction(self.model, phi if phi is not None else 0.0, self.spec.initial_batch)

    def _max_batch(self, mode: str) -> int:
        if mode == "fixed" or (mode == "goodput" and self.gns() is None):
            return int(self.spec.initial_batch)  # no batch adaptation without a noise scale
        return int(self.spec.max_batch)

    def fixed_split(self, g: int, batch: int | None = None) -> BatchConfig:
        """``batch`` (default M0) over ``g`` slots, the fewest accumulation steps the memory cap allows."""
        batch = int(batch or self.spec.initial_batch)
        local = math.ceil(batch / max(g, 1))
        s = max(0, math.ceil(local / self.spec.per_slot_batch[1]) - 1)
        return BatchConfig(batch, s)

    def _optimize(self, gpus, mode: str):
        fn = self.goodput_function(mode)
        lo, hi = self.spec.per_slot_batch
        gpus = np.asarray(gpus)
        return fn, fn.optimize(np.ones_like(gpus), gpus, max_batch=self._max_batch(mode),
                               atomic_bsz_range=(lo, hi), accumulation=True, force_accum_single_gpu=False)

    def goodput_curve(self, max_gpus: int, gpus_per_node: int = 1, mode: str | None = None,
                      upto: int | None = None) -> np.ndarray:
        """Predicted goodput (Pollux Eq. (1)) in M0-steps per second at g = 0..max_gpus slots, best batch per
        g (fixed mode: M0 split over g). Before the first fit: g times the rate measured so far (or 1).
        Only g <= ``upto`` is evaluated (the rest is 0)."""
        mode = mode or self.batch_mode
        top = max_gpus if upto is None else max(min(int(upto), max_gpus), 0)
        out = np.zeros(max_gpus + 1)
        if top < 1:
            return out
        gg = np.arange(1, top + 1)
        m0 = float(self.spec.initial_batch)
        if self.model is None:
            st = self.handle.status() if self.handle is not None else {}
            sps, ws = st.get("samples_per_s"), st.get("world_size") or 0
            rate1 = sps / ws / m0 if sps and ws else 1.0
            out[1:top + 1] = gg * rate1
            return out
        with np.errstate(divide="ignore", invalid="ignore"):
            if mode == "fixed":
                fn = self.goodput_function(mode)
                split = [self.fixed_split(int(k)) for k in gg]
                b = np.array([c.per_worker_batch(int(k)) for c, k in zip(split, gg)])
                s = np.array([c.accum_steps for c in split])
                good = np.where(b >= self.spec.per_slot_batch[0], fn.evaluate(1, gg, b, s), 0.0)
            else:
                _, (good, _, _) = self._optimize(gg, mode)
        out[1:top + 1] = np.nan_to_num(np.asarray(good, dtype=float) / m0, nan=0.0, posinf=0.0)
        return out

    def speedup_curve(self, max_gpus: int, gpus_per_node: int = 1, mode: str | None = None,
                      upto: int | None = None) -> np.ndarray:
        """:meth:`goodput_curve` over its 1-slot value (Pollux Eq. (8)); linear before the first fit."""
        good = self.goodput_curve(max_gpus, gpus_per_node, mode, upto)
        if self.model is None or good[1] <= 0:
            out = np.arange(max_gpus + 1, dtype=float)
            if upto is not None:
                out[int(upto) + 1:] = 0.0
            return out
        return good / good[1]

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
        lim = min(max(2 * self.max_profiled_replicas, 1), cap, sp.max_slots)
        lim = min(lim, max(self._max_batch(self.batch_mode) // sp.per_slot_batch[0], 1))
        return max(int(lim), 1)

    def best_batch(self, g: int, mode: str | None = None, current: BatchConfig | None = None,
                   hysteresis: float = 1.05) -> BatchConfig:
        """The batch to run at ``g`` slots: Pollux's agent ``argmax_{m,s} GOODPUT`` (Pollux §4.1) in goodput
        mode, the throughput maximiser in throughput mode, M0 split over ``g`` in fixed mode or before a
        fit. Keeps ``current`` unless the new choice is predicted ``hysteresis`` times better."""
        mode = mode or self.batch_mode
        if g < 1:
            raise ValueError(f"best_batch needs g >= 1 slots, got {g!r}")
        if mode == "fixed" or self.model is None:
            return self.fixed_split(g)
        fn, (good, m, s) = self._optimize(np.array([g]), mode)
        m, s, good = int(m[0]), int(s[0]), float(good[0])
        if m < 1 or good <= 0:
            return self.fixed_split(g)
        lo = self.spec.per_slot_batch[0]
        while g * m * (s + 1) > self._max_batch(mode) and m > lo:
            m -= 1
        choice = BatchConfig(max(g * m * (s + 1), int(self.spec.initial_batch)), s)
        if current is not None and current.global_batch <= self.spec.max_batch:
            now = float(fn.evaluate(1, g, current.per_worker_batch(g), current.accum_steps))
            new = float(fn.evaluate(1, g, choice.per_worker_batch(g), choice.accum_steps))
            if now > 0 and new < hysteresis * now:
                return current
        return choice

    def predicted_goodput(self) -> float | None:
        """Goodput of the current configuration by the fitted model (M0-samples per second)."""
        if self.model is None or self.handle is None or self.world_size < 1:
            return None
        st = self.handle.status()
        if not st.get("global_batch"):
            return None
        fn = self.goodput_function("goodput")
        return float(fn.evaluate(1, st["world_size"], st["per_worker_batch"], st["accum_steps"]))

    def jct(self, now: float) -> float | None:
        """Job completion time (submission to finish), or the time so far while it runs."""
        if self.state == "dropped":
            return None
        end = self.finish_time if self.finish_time is not None else now
        return max(end - self.submission_time, 0.0)
