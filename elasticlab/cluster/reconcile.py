"""Applying a scheduling round to the jobs, as a reconciliation: every tick each job's
:class:`~elasticlab.cluster.view.Target` (slots, batch) is compared with what its handle runs, and at
most one request per job is put in flight (:class:`~elasticlab.cluster.view.InFlight`): shrinks and pauses
first, so that grows find their slots; a grow only into free slots; a batch change at an unchanged size.
A finished request releases or takes the slots it changed.

:class:`Reconciler` is a base of :class:`~elasticlab.cluster.scheduler.Scheduler`; it works on the
scheduler's ``_jobs``, ``slots``, ``_lock`` and ``_events`` and starts jobs with its ``_launch_job``.
"""
from __future__ import annotations

from functools import partial

from elasticlab.cluster.view import TERMINAL, InFlight, LiveJob, LiveState
from elasticlab.elastic.requests import Kind
from elasticlab.elastic.states import JobState


class Reconciler:
    """Bring the jobs to their targets, one request in flight per job (see the module docstring)."""

    def _apply(self, now: float) -> None:
        with self._lock:
            jobs = sorted((j for j in self._jobs.values() if j.state not in TERMINAL),
                          key=lambda j: (j.submission_time, j.name))
            free = self.slots - sum(j.held for j in jobs)
        # shrinks and pauses first, so that grows find their slots
        for j in jobs:
            n, batch = j.target
            if j.pending is not None or j.handle is None or j.state != LiveState.RUNNING:
                continue
            ws = j.handle.status()["world_size"]
            if n == 0:
                self._request(j, Kind.PAUSE, j.handle.pause, n=0)
            elif n < ws:
                self._request(j, Kind.RESIZE, partial(j.handle.resize, n, global_batch=batch.global_batch,
                                                           accum_steps=batch.accum_steps),
                              n=n, batch=batch, from_size=ws)
        for j in jobs:
            n, batch = j.target
            if j.pending is not None or n == 0:
                continue
            if j.handle is None and j.state == LiveState.QUEUED:
                if n <= free:
                    free -= n
                    j.held, j.state, j.start_time = n, LiveState.STARTING, now
                    try:
                        j.handle = self._launch_job(j, n, batch)
                    except Exception as e:
                        j.error = f"could not start: {e!r}"
                        self._end(j, LiveState.FAILED, now)
                        continue
                    self._events.emit("start", job=j.name, slots=n, global_batch=batch.global_batch,
                                      wait_s=now - j.submission_time)
                continue
            if j.handle is None:
                continue
            st = j.handle.status()
            if j.state == LiveState.PAUSED and st["state"] == JobState.PAUSED:
                if n - j.held <= free:
                    free -= n - j.held
                    j.held = n
                    self._request(j, Kind.RESUME, partial(j.handle.resume, n), n=n)
                continue
            if j.state != LiveState.RUNNING or st["state"] != JobState.RUNNING:
                continue
            ws = st["world_size"]
            if n > ws:
                if n - j.held <= free:
                    free -= n - j.held
                    j.held = n
                    self._request(j, Kind.RESIZE, partial(j.handle.resize, n, global_batch=batch.global_batch,
                                                               accum_steps=batch.accum_steps),
                                  n=n, batch=batch, from_size=ws)
            elif n == ws and batch is not None and st.get("global_batch") and \
                    getattr(j.handle, "supports_batch", True) and (
                    batch.global_batch != st["global_batch"] or batch.accum_steps != st["accum_steps"]):
                self._request(j, Kind.SET_BATCH, partial(j.handle.set_batch, batch.global_batch,
                                                              accum_steps=batch.accum_steps),
                              n=n, batch=batch)

    def _request(self, j: LiveJob, kind: Kind, call, **info) -> None:
        """Ask ``j``'s handle (``call()``) and keep the future as the job's one request in flight."""
        try:
            fut = call()
        except RuntimeError as e:  # the job ended between the status read and the request
            self._events.emit("request_failed", job=j.name, request=str(kind), error=str(e))
            return
        j.pending = InFlight(kind, fut, info)
        if kind in (Kind.RESIZE, Kind.PAUSE, Kind.RESUME):
            j.num_restarts += 1
        extra = {k: v for k, v in info.items() if k != "batch"}
        if info.get("batch") is not None:
            extra.update(global_batch=info["batch"].global_batch, accum_steps=info["batch"].accum_steps)
        self._events.emit(str(kind), job=j.name, **extra)

    def _settle(self, j: LiveJob, now: float) -> None:
        """Resolve the request in flight: release the slots a finished shrink or pause gave back."""
        if j.pending is None:
            return
        kind, fut, info = j.pending
        if not fut.done():
            return
        j.pending = None
        if fut.exception() is not None:
            self._events.emit("request_failed", job=j.name, request=str(kind), error=repr(fut.exception()))
            return
        if kind == Kind.PAUSE:
            j.held, j.state = 0, LiveState.PAUSED
        elif kind in (Kind.RESIZE, Kind.RESUME):
            j.held = info["n"]
        self._events.emit(f"{kind}_done", job=j.name, **{k: v for k, v in info.items() if k != "batch"},
                          result=fut.result() if kind != Kind.PAUSE else None)
