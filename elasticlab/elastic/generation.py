"""A job's generations: forming one (the controller's rendezvous: membership, ranks, the store, the
checkpoint to load) and ending one (drain at a step boundary, then what the drain was for).

Torch's elastic agent calls this ``_rendezvous`` / ``_restart_workers``; here the controller alone decides
each generation's membership and ranks, once, and sends them in each member's
:class:`~elasticlab.elastic.messages.Join`. :class:`Generations` is a base of
:class:`~.controller.JobController` and runs in its thread, on the controller's state (``_state``,
``_gen``, ``_active``, ``_store``, ``_target``, ``_pending``, ``_last_step``, the rollback counters).
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

from elasticlab.elastic import messages as M
from elasticlab.elastic.requests import Kind
from elasticlab.elastic.states import DrainReason, JobState, OnNoCheckpoint, WorkerState

S, W, D = JobState, WorkerState, DrainReason


class Generations:
    """Form, drain and end generations (see the module docstring)."""

    # ---- ending one ---------------------------------------------------------------------------
    def _drain(self, reason: DrainReason, deadline: float | None = None) -> None:
        """The generation leaves its group (because of ``reason``); kill what is left after ``deadline``."""
        with self._lock:
            self._set_state(S.DRAINING)
            self._drain_reason, self._drain_deadline = DrainReason(reason), deadline

    def _leave(self, reason: DrainReason) -> None:
        self._drain(reason)
        self._send_rank0(M.Command.LEAVE)

    def _check_drained(self) -> None:
        if self._pending_failure is not None:  # the job may be failing: form nothing new meanwhile
            return
        busy = [w for w in self._active if w.state == W.ACTIVE]
        if busy:
            if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                self._kill_stragglers(busy)
            return
        self._close_store()
        with self._lock:
            self._active = []
        reason = self._drain_reason
        if reason == D.FINISHED:
            self._finish(S.FINISHED)
        elif reason == D.STOP:
            self._finish(S.STOPPED)
        elif reason == D.PAUSE:
            self._set_state(S.PAUSED)
            self._events.emit("pause", step=self._last_step)
            req = self._pending.pop(Kind.PAUSE, None)
            if req:
                req.future.set_result(self._last_step)
        elif reason == D.FAULT:
            self._start_generation(restart=True)
        else:  # resize
            self._start_generation()

    def _finish(self, state: JobState) -> None:
        self._pool.shutdown()
        with self._lock:
            self._set_state(state)
            self._active = []
        if state == S.STOPPED:
            self._events.emit("stop", step=self._last_step)
        req = self._pending.pop(Kind.STOP, None)
        if req:
            req.future.set_result(self._last_step)

    def _close_store(self) -> None:
        if self._store is not None:
            self._store = None  # dropping the master store closes its listening port

    # ---- forming one --------------------------------------------------------------------------
    def _start_generation(self, restart: bool = False) -> None:
        if restart:
            self._restart_pending = True
        if len(self._pool.idle()) < self._target:
            self._pool.spawn_upto(self._target)
            self._set_state(S.SPAWNING)
            return
        self._form(self._target)

    def _resume_from(self):
        """The newest loadable checkpoint, the newer ones that did not verify, and the step through which
        the record holds every rank's rows (None without a record). With a sample record, the
        newest at or before the last step whose rows every rank of the last generation sent: a rank that
        died after a step's all-reduce but before its rows left took them with it, while rank 0 may have
        checkpointed that step (the steps after the checkpoint run again). If none is left there, the
        newest, and a ``record_gap`` event says that the record misses rows."""
        through = min(self._recorded.values()) if self._record_file is not None and self._recorded else None
        path, bad, gap = self.checkpoint_dir.latest_recorded(through, exclude=self._rejected)
        if gap:
            self._events.emit("record_gap", generation=self._gen, recorded_through=through,
                              checkpoint=str(path))
        for p, why in bad:
            self._events.emit("checkpoint_corrupt", path=str(p), reason=why)
        return (str(path) if path else None), bad, through

    def _new_store(self):
        """The generation's c10d TCPStore, listening on ``store_host`` only (default 127.0.0.1; torch's own
        master would bind every interface): :func:`elasticlab.elastic.rendezvous.bind_store`."""
        from elasticlab.elastic.rendezvous import bind_store

        host = self.options.get("store_host") or "127.0.0.1"
        try:
            return bind_store(host, 0, timeout_s=self.options["timeout_s"])
        except OSError as e:
            raise ValueError(f"cannot listen on store_host={host!r}: {e}") from e

    def _form(self, n: int) -> None:
        """Form the next generation of ``n`` idle workers from the newest loadable checkpoint: the
        membership and the ranks are decided here, once, and sent in each member's Join."""
        checkpoint, bad, recorded_through = self._resume_from()
        members = [w for w in self._pool.idle() if w.proc.is_alive()][:n]
        if len(members) < n:  # one died idle and its sentinel is not handled yet: spawn and come back
            self._pool.spawn_upto(self._target)
            self._set_state(S.SPAWNING)
            return
        if checkpoint is None and (bad or self._rejected or self._high_water > 0):
            what = ", ".join(sorted({str(p) for p, _ in bad} | self._rejected)) or "none was written"
            if self.options.get("on_no_checkpoint", OnNoCheckpoint.RESTART) == OnNoCheckpoint.FAIL:
                self._fail(f"no loadable checkpoint left ({what}) and on_no_checkpoint='fail'")
                return
            self._events.emit("no_checkpoint", unusable=what, step=self._last_step)
        self._close_store()
        self._store = self._new_store()
        host = self.options.get("store_host") or "127.0.0.1"
        with self._lock:
            self._gen += 1
            gen = self._gen
        batch = self._decide_batch(n)
        ck_step = int(Path(checkpoint).stem.split("-")[1]) if checkpoint else 0
        self._recorded = dict.fromkeys(range(n), ck_step)
        gone = []
        for rank, w in enumerate(members):
            w.state, w.rank = W.ACTIVE, rank
            try:
                w.conn.send(M.Join(gen, rank, n, self._store.port, checkpoint,
                                   str(self.checkpoint_dir.directory),
                                   (batch.global_batch, batch.accum_steps) if batch else None, host))
            except (OSError, ValueError):
                gone.append(w.id)
        with self._lock:
            self._active = members
            self._set_state(S.RUNNING)
        self._events.emit("generation", generation=gen, world_size=n, port=self._store.port,
                          checkpoint=checkpoint, from_step=ck_step,
                          workers=[w.id for w in members])
        lost = max(0, self._last_step - ck_step)  # a rollback, after a fault or onto an older checkpoint
        if self._restart_pending or lost:
            self._restart_pending = False
            self._lost_steps += lost
            self._replays += bool(lost)
            self._events.emit("restart", generation=gen, from_step=ck_step, last_step=self._last_step,
                              lost_steps=lost, world_size=n, checkpoint=checkpoint,
                              recorded_through=recorded_through)
            with self._lock:
                self._last_step = ck_step
        # a resize (or resume) is done at the first step of this generation -- also when the generation
        # first formed for it was abandoned
        req = self._pending.pop(Kind.RESIZE, None) or self._pending.pop(Kind.RESIZE_DONE, None)
        if req:
            req.generation = gen
            self._pending[Kind.RESIZE_DONE] = req
        if gone:
            self._abort(f"worker(s) {gone} were gone before they could join generation {gen}")

    def _send_rank0(self, command: M.Command, global_batch: int = 0, accum_steps: int = 0) -> None:
        r0 = next((w for w in self._active if w.rank == 0), None)
        if r0 is not None:
            with contextlib.suppress(Exception):  # tagged: a generation ignores its predecessors' leftovers
                r0.conn.send(M.Control(self._gen, command, global_batch, accum_steps))
