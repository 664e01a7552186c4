"""The batch and goodput decisions of an :class:`~elasticlab.elastic.ElasticJob` (AdaptDL's job-side
loop): the batch each generation starts with (a request's, else the batch policy's), the periodic refit of
the throughput model to the measured step times (Pollux §4.1) with the predicted goodput, and the
goodput-adaptive policy's re-decision after each refit.

:class:`BatchAdaptation` is a base of :class:`~elasticlab.elastic.ElasticJob`; the controller calls
``_decide_batch`` when it forms a generation and ``_maybe_refit`` after each step. It uses the job's
``policy``, ``_refit_every_s``, ``_next_refit``, ``_fit_thread`` (set in ``ElasticJob.__init__``) and the
controller's ``_batch``, ``_last_rec``, ``_throughput``, ``_predicted_goodput``, ``_pending``.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time

from elasticlab.elastic.policies import BatchConfig, GoodputAdaptive
from elasticlab.elastic.requests import Kind
from elasticlab.elastic.states import JobState


class BatchAdaptation:
    """The job's batch decisions and goodput refits (see the module docstring)."""

    def _decide_batch(self, n: int) -> BatchConfig | None:
        req = self._pending.get(Kind.RESIZE)
        if req and req.batch is not None:
            return req.batch
        req = self._pending.get(Kind.SET_BATCH)  # asked for, but the generation ended before it took effect
        if req:
            return req.batch
        if self.policy is None:
            return self._batch
        stats = {"current": self._batch, "throughput_model": self._throughput,
                 "gns": (self._last_rec or {}).get("gns")}
        try:
            return self.policy.decide(n, stats)
        except Exception as e:
            self._events.emit("error", message=f"batch policy failed, batch kept: {e!r}")
            return self._batch

    def _maybe_refit(self, rec: dict) -> None:
        """Refit in a background thread every ``goodput_refit_s`` seconds (one fit at a time)."""
        if self._refit_every_s and time.monotonic() >= self._next_refit and (
                self._fit_thread is None or not self._fit_thread.is_alive()):
            self._next_refit = time.monotonic() + self._refit_every_s
            self._fit_thread = threading.Thread(target=self._refit_goodput, args=(rec,), daemon=True,
                                                name="elasticlab-goodput-fit")
            self._fit_thread.start()

    def _refit_goodput(self, rec: dict) -> None:
        """Fit the throughput model to the measured step times (Pollux §4.1, one row per configuration)
        and predict the goodput of the current configuration. Runs in its own thread: a fit can take
        seconds, and the controller must keep serving the workers meanwhile."""
        try:
            from elasticlab import goodput as gp
        except ImportError:
            return
        rows = self.step_times(aggregate=True)
        if not rows:
            return
        try:
            model = gp.fit_throughput_model(rows)
            self._throughput = model
            with self._lock:  # the newest step: a fit can take long enough for the GNS to appear meanwhile
                rec = dict(self._last_rec or rec)
            gns = rec.get("gns")
            if gns is not None and math.isfinite(gns):
                base = self._base_batch()
                fn = gp.GoodputFunction(model, gns, base)
                self._predicted_goodput = float(fn.evaluate(1, rec["world_size"], rec["per_worker_batch"],
                                                            rec["accum_steps"]))
        except Exception:  # a fit needs enough distinct configurations; keep the previous one
            return
        self._adapt_batch(rec)

    def _adapt_batch(self, rec: dict) -> None:
        """Goodput-adaptive policy: re-decide (m, s) for the current size with the new fit (AdaptDL
        re-decides at every pass over the data; here at every refit), with the policy's hysteresis."""
        if not isinstance(self.policy, GoodputAdaptive) or self.state != JobState.RUNNING:
            return
        current = BatchConfig(rec["global_batch"], rec["accum_steps"])
        try:
            choice = self.policy.decide(rec["world_size"], {"current": current, "gns": rec.get("gns"),
                                                            "throughput_model": self._throughput})
        except Exception as e:
            self._events.emit("error", message=f"goodput policy failed: {e!r}")
            return
        if choice != current:
            last = self.policy.last
            self._events.emit("adapt", step=rec["step"], global_batch=choice.global_batch,
                              accum_steps=choice.accum_steps, per_worker_batch=last.get("per_worker_batch"),
                              goodput=last.get("goodput"), current_goodput=last.get("current_goodput"))
            with contextlib.suppress(RuntimeError):
                self._request(Kind.SET_BATCH, batch=choice)

    def _base_batch(self) -> int:
        pol = self.policy
        if pol is not None and hasattr(pol, "initial_global_batch"):
            return int(pol.initial_global_batch())
        return int(self._batch.global_batch) if self._batch else 1

