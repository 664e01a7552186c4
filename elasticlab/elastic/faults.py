"""What a fault does to an :class:`~elasticlab.elastic.ElasticJob`: a worker's exception, a worker's death,
a generation abandoned, the job failed. The table is :class:`~elasticlab.elastic.states.JobState`'s
docstring; torch's elastic agent keeps the same split (``_monitor_workers`` reports, the agent restarts).

:class:`FaultHandling` is a base of :class:`~.controller.JobController` and runs in its thread; it reads and
writes the controller's state (``_state``, ``_gen``, ``_active``, ``_pool``, ``_pending``, the counters
``_restarts``, ``_failed_gens``, ``_high_water``) and calls its ``_drain`` and ``_close_store``.
"""
from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

from elasticlab.elastic import messages as M
from elasticlab.elastic.pool import PoolWorker
from elasticlab.elastic.requests import Kind
from elasticlab.elastic.states import TERMINAL, DrainReason, JobState, WorkerState

S, W, D = JobState, WorkerState, DrainReason

#: How long a worker exception waits for a peer's death that would explain it (seconds).
FAILURE_SETTLE_S = 0.5


class PendingFailure(NamedTuple):
    """A worker exception that fails the job at ``due`` unless a member of ``generation`` dies first."""

    due: float  # time.monotonic()
    generation: int
    error: str
    traceback: str | None


class FaultHandling:
    """Worker errors and deaths, abandoned generations, the failed job (see the module docstring)."""

    def _on_error(self, w: PoolWorker, msg: M.Error) -> None:
        """A worker's exception; what it does to the job is :class:`~.states.JobState`'s table."""
        self._events.emit("error", worker=msg.worker_id, generation=msg.generation, message=msg.text,
                          error_kind=msg.kind, rank=w.rank, traceback=msg.traceback)
        if self._state in TERMINAL:
            return
        if msg.generation is None:  # the task could not even be built: nothing will work
            self._fail(f"worker {msg.worker_id}: {msg.text}", msg.traceback)
            return
        if msg.generation != self._gen:  # a leftover of a generation already abandoned
            return
        where = f"worker {msg.worker_id} (rank {w.rank}, generation {msg.generation})"
        if msg.kind == "checkpoint_load":
            if msg.path and msg.path not in self._rejected:
                self._rejected.add(msg.path)
                self._events.emit("checkpoint_corrupt", path=msg.path, reason=msg.text)
            self._abort(f"checkpoint did not load on {where}", count=False)
        elif msg.kind in ("formation", "comm"):
            self._abort(f"{msg.kind} error on {where}: {msg.text}", traceback=msg.traceback)
        elif self._restarts < self.options.get("max_restarts", 0):
            self._restarts += 1
            self._events.emit("retry", worker=msg.worker_id, generation=msg.generation, error_kind=msg.kind,
                              restarts=self._restarts, max_restarts=self.options.get("max_restarts", 0))
            self._abort(f"{msg.kind} error on {where} (retry {self._restarts})", count=False)
        else:  # task and checkpoint_io errors: fail fast -- unless a peer's death explains it
            # (a SIGKILLed peer resets its sockets a moment before its exit can be seen: wait that long)
            if self._pending_failure is None:
                self._pending_failure = PendingFailure(time.monotonic() + FAILURE_SETTLE_S, msg.generation,
                                                       f"{msg.kind} error on {where}: {msg.text}",
                                                       msg.traceback)

    def _settle_failure(self) -> None:
        """Fail the job for a worker exception, unless a member of its generation died meanwhile (then the
        error was the death's echo in a collective, and the generation is re-formed as for any fault)."""
        pf = self._pending_failure
        dead = [w for w in self._active if not w.proc.is_alive()] if pf.generation == self._gen else []
        if pf.generation in self._death_gens or dead:
            self._pending_failure = None
            self._events.emit("error_explained", generation=pf.generation, message=pf.error,
                              reason="a member of the generation died")
            return
        if time.monotonic() >= pf.due:
            self._pending_failure = None
            self._fail(pf.error, pf.traceback)

    def _fail(self, error: str, traceback: str | None = None) -> None:
        """The job FAILED with ``error``; the loop ends and kills every worker."""
        if self._state in TERMINAL:
            return
        with self._lock:
            self._error, self._traceback = error, traceback
            self._set_state(S.FAILED)
        self._close_store()
        self._events.emit("failed", message=error, step=self._last_step, generation=self._gen)

    def _abort(self, why: str, count: bool = True, traceback: str | None = None) -> None:
        """Abandon the current generation (a member died, its group cannot form or broke, a checkpoint
        did not load): close its store so that every member waiting in the rendezvous stops at once,
        give them ``abort_grace_s`` to leave, kill the ones that do not, and form a new generation.
        ``count``: the generation counts toward ``max_failed_generations`` unless it took the job
        past its furthest step."""
        if self._state not in (S.RUNNING, S.DRAINING) or not self._active:
            return
        gen = self._gen
        self._close_store()
        if self._aborted_gen == gen:  # already abandoned; a second member's error changes nothing
            return
        self._aborted_gen = gen
        self._events.emit("abort", generation=gen, reason=why, step=self._last_step)
        if count:
            self._failed_gens += 1
            limit = int(self.options.get("max_failed_generations", 5))
            if self._failed_gens >= limit:
                self._fail(f"{self._failed_gens} generations in a row failed without progress past step "
                           f"{self._high_water} (max_failed_generations={limit}); last: {why}", traceback)
                return
        req = self._pending.pop(Kind.CHECKPOINT, None)
        if req and not req.future.done():
            req.future.set_exception(
                RuntimeError(f"generation {gen} was abandoned before the checkpoint: {why}"))
        with self._lock:
            reason = self._drain_reason if (self._state == S.DRAINING and self._drain_reason in (
                D.STOP, D.FINISHED, D.PAUSE)) else D.FAULT
            self._drain(reason, time.monotonic() + float(self.options.get("abort_grace_s", 3.0)))

    def _on_death(self, w: PoolWorker) -> None:
        was, code = self._pool.bury(w)
        if self._state == S.STOPPED:
            return
        self._events.emit("fault", worker=w.id, pid=w.pid, exitcode=code, rank=w.rank, was=was,
                          generation=self._gen, step=self._last_step)
        if was == W.ACTIVE and self._state in (S.RUNNING, S.DRAINING) and w in self._active:
            self._death_gens.add(self._gen)
            self._abort(f"worker {w.id} (rank {w.rank}) died with exit code {code}")
            if self._state not in TERMINAL:  # start its replacement now, while the others leave
                self._pool.spawn_upto(max(self.warm, self._target))
        elif was == W.STARTING and not any(x.state in (W.IDLE, W.ACTIVE) for x in self._pool.values()):
            self._error = f"worker {w.id} died while starting (exit code {code})"

    def _kill_stragglers(self, busy: list[PoolWorker]) -> None:
        """Members still in an abandoned generation after its deadline (stuck in a collective with a dead
        peer): kill them, so that they are replaced."""
        for w in busy:
            self._events.emit("fault", worker=w.id, pid=w.pid, reason="did not leave the group",
                              generation=self._gen)
            with contextlib.suppress(Exception):
                w.proc.kill()
