"""The controller thread of an :class:`~elasticlab.elastic.ElasticJob`: it serves the worker pool's
messages, takes the caller's requests at step boundaries, and drives the job's state machine.

:class:`JobController` is the base of :class:`~elasticlab.elastic.ElasticJob`, which adds the public API
and queues :class:`~.requests.Request` records. Forming and ending generations is
:class:`~.generation.Generations`, what faults do is :class:`~.faults.FaultHandling` (both bases of this
class, run in its thread). Every state change goes through :meth:`JobController._set_state`, which checks
it against :data:`~elasticlab.elastic.states.TRANSITIONS`.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import queue
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import wait as mp_wait

from elasticlab.elastic import messages as M
from elasticlab.elastic.faults import FAILURE_SETTLE_S, FaultHandling, PendingFailure
from elasticlab.elastic.generation import Generations
from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.pool import PoolWorker, WorkerPool
from elasticlab.elastic.records import EventLog, RecordLog
from elasticlab.elastic.requests import Kind, Request
from elasticlab.elastic.states import TERMINAL, DrainReason, JobState, WorkerState, check_transition

S, W, D = JobState, WorkerState, DrainReason

__all__ = ["JobController", "FAILURE_SETTLE_S"]


class JobController(Generations, FaultHandling):
    """The controller's state and thread (see the module docstring)."""

    def __init__(self, start_method: str):
        self._lock = threading.RLock()
        self._pool = WorkerPool(start_method, self.entrypoint, self.entry_kwargs, self.options, self._lock)
        self._requests: queue.Queue[Request] = queue.Queue()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._active: list[PoolWorker] = []
        self._state = S.NEW
        self._gen = 0
        self._store = None
        self._drain_reason: DrainReason | None = None
        self._drain_deadline = None
        self._restart_pending = False  # the next generation replaces one lost to a fault
        self._pending: dict[Kind, Request] = {}  # the requests under way, one per kind
        self._last_step = 0
        self._last_rec: dict | None = None
        self._epoch = 0
        self._batch: BatchConfig | None = None
        self._throughput = None  # the fitted throughput model (see ElasticJob._refit_goodput)
        self._predicted_goodput = None
        self._lost_steps = 0
        self._thread: threading.Thread | None = None
        self._metrics = RecordLog()
        self._events = EventLog()
        self._record_file = None
        self._recorded: dict[int, int] = {}  # rank -> the last step of the generation whose rows arrived
        self._error: str | None = None
        self._traceback: str | None = None
        self._rejected: set[str] = set()  # checkpoints that verified but did not load
        self._replays = 0  # formations that rolled the job back (lost_steps > 0)
        self._restarts = 0  # task errors retried under max_restarts
        self._high_water = 0  # the furthest step the job reached
        self._failed_gens = 0  # generations in a row that ended in a fault without passing _high_water
        self._aborted_gen = 0  # the last generation abandoned (counted once)
        self._death_gens: set[int] = set()  # generations in which a member died
        self._pending_failure: PendingFailure | None = None  # a worker exception not yet decided

    def _set_state(self, new: JobState) -> None:
        with self._lock:
            check_transition(self._state, new)
            self._state = new

    # ---- the thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._pool.spawn_upto(self.warm)
            import torch.distributed  # noqa: F401  (the controller hosts each generation's TCPStore)
            while True:
                ready = mp_wait([self._wake_r, *self._pool.waitables()], timeout=0.25)
                for obj in ready:
                    if obj is self._wake_r:
                        while self._wake_r.poll():
                            self._wake_r.recv()
                        continue
                    for w in self._pool.values():
                        if obj is w.conn:
                            self._pool.drain(w, self._on_message)
                        elif obj == w.proc.sentinel and w.state != W.DEAD:
                            self._pool.drain(w, self._on_message)
                            self._on_death(w)
                if self._record_file is not None:
                    self._record_file.flush()
                self._advance()
                if self._state in TERMINAL:
                    break
        except Exception as e:  # never leave processes behind because of a controller bug
            import traceback

            self._error = f"controller failed: {e!r}"
            self._traceback = "".join(traceback.format_exception(e)).strip()
            self._events.emit("error", message=self._error)
            with self._lock:
                self._state = S.FAILED  # from any state: not checked
        finally:
            self._pool.kill_all()
            self._fail_pending(RuntimeError(f"the job is {self._state}"))
            if self._record_file is not None:
                self._record_file.close()
                self._record_file = None

    def _on_message(self, w: PoolWorker, msg) -> None:
        if isinstance(msg, M.Ready):
            w.state = W.IDLE
            w.pid = msg.pid
            self._events.emit("ready", worker=w.id, pid=w.pid)
        elif isinstance(msg, M.Step):
            self._on_step(msg.record)
        elif isinstance(msg, M.Samples):
            if msg.row.get("generation") == self._gen:  # the rows of each rank that reached the record
                rank, step = int(msg.row["rank"]), int(msg.row["step"])
                self._recorded[rank] = max(self._recorded.get(rank, step), step)
            if self._record_file is not None:
                self._record_file.write(json.dumps(msg.row) + "\n")
        elif isinstance(msg, M.Checkpointed):
            self._rejected.discard(msg.path)  # written anew: no longer the file that did not load
            self._events.emit("checkpoint", generation=msg.generation, step=msg.step, path=msg.path,
                              probe_loss=msg.probe_loss, reason=msg.reason)
            req = self._pending.get(Kind.CHECKPOINT)
            if req and msg.step >= req.min_step:
                del self._pending[Kind.CHECKPOINT]
                req.future.set_result(msg.step)
        elif isinstance(msg, M.Resumed):
            self._events.emit("resume", generation=msg.generation, step=msg.step, probe_loss=msg.probe_loss,
                              checkpoint=msg.checkpoint, world_size=len(self._active), formed_s=msg.formed_s,
                              backend=msg.backend)
        elif isinstance(msg, M.Scheduled):  # rank 0 leaves at a scheduled step; re-form at the scheduled size
            if self._state == S.RUNNING and msg.generation == self._gen:
                self._target = msg.world_size
                self._pending[Kind.RESIZE] = Request(Kind.RESIZE, Future(), time.perf_counter(),
                                                     n=msg.world_size, from_size=len(self._active),
                                                     scheduled=msg.step)
                self._drain(D.RESIZE)
        elif isinstance(msg, M.Left):
            pass
        elif isinstance(msg, M.Finished):
            self._rejected.discard(msg.path)
            self._events.emit("checkpoint", generation=msg.generation, step=msg.step, path=msg.path,
                              probe_loss=msg.probe_loss, reason="final")
            self._events.emit("finished", generation=msg.generation, step=msg.step)
            self._drain(D.FINISHED)
        elif isinstance(msg, M.Idle):
            if w.state != W.DEAD:
                w.state, w.rank = W.IDLE, None
        elif isinstance(msg, M.Error):
            self._on_error(w, msg)

    def _on_step(self, rec: dict) -> None:
        rec["predicted_goodput"] = self._predicted_goodput
        if rec["step"] > self._high_water:
            self._high_water, self._failed_gens = rec["step"], 0
        with self._lock:
            self._last_step, self._last_rec = rec["step"], rec
            self._batch = BatchConfig(rec["global_batch"], rec["accum_steps"])
        self._metrics.append(rec)
        now = time.perf_counter()
        req = self._pending.get(Kind.RESIZE_DONE)
        if req and rec["generation"] == req.generation:
            del self._pending[Kind.RESIZE_DONE]
            res = {"world_size": rec["world_size"], "step": rec["step"], "latency_s": now - req.t_request}
            if req.kind == Kind.RESUME:  # a resume from pause, done at its generation's first step
                self._events.emit("resumed", world_size=rec["world_size"], step=rec["step"],
                                  latency_s=res["latency_s"])
            else:
                self._events.emit("resize", from_size=req.from_size, to_size=rec["world_size"],
                                  step=rec["step"], latency_s=res["latency_s"])
            req.future.set_result(res)
        req = self._pending.get(Kind.SET_BATCH)
        if req and rec["step"] > req.step and rec["global_batch"] == req.batch.global_batch \
                and rec["accum_steps"] == req.batch.accum_steps:
            del self._pending[Kind.SET_BATCH]
            self._events.emit("set_batch", step=rec["step"], global_batch=rec["global_batch"],
                              accum_steps=rec["accum_steps"])
            req.future.set_result({"step": rec["step"], "global_batch": rec["global_batch"],
                                   "accum_steps": rec["accum_steps"]})
        self._maybe_refit(rec)

    # ---- state machine -------------------------------------------------------------------------
    def _advance(self) -> None:
        if self._pending_failure is not None and self._state not in TERMINAL:
            self._settle_failure()
        st = self._state
        if st == S.FAILED:
            return
        if st == S.STARTING:
            if len(self._pool.idle()) >= self._target:  # a checkpoint dir from an earlier run is resumed
                self._form(self._target)
            elif self._error:
                self._set_state(S.FAILED)
            return
        if st == S.RUNNING:
            self._take_requests()
            return
        if st == S.DRAINING:
            self._check_drained()
            return
        if st == S.SPAWNING:
            if len(self._pool.idle()) >= self._target:
                self._form(self._target)
            else:  # replace any that died while starting
                self._pool.spawn_upto(self._target)
            return
        if st == S.PAUSED:
            self._take_requests()

    def _take_requests(self) -> None:
        """Take the queued requests in order, up to the first that ends the generation."""
        while True:
            try:
                req = self._requests.get_nowait()
            except queue.Empty:
                return
            st, fut, kind = self._state, req.future, req.kind
            if kind == Kind.STOP:
                self._pending[Kind.STOP] = req
                if st == S.RUNNING:
                    self._leave(D.STOP)
                else:
                    self._finish(S.STOPPED)
                return
            if kind == Kind.RESIZE:
                if st == S.PAUSED:
                    self._target = req.n
                    fut.set_result({"world_size": req.n, "step": self._last_step, "latency_s": 0.0})
                    continue
                if req.n == len(self._active) and req.batch is None:
                    fut.set_result({"world_size": req.n, "step": self._last_step, "latency_s": 0.0})
                    continue
                self._target = req.n
                req.from_size = len(self._active)
                self._pending[Kind.RESIZE] = req
                self._leave(D.RESIZE)
                return
            if kind == Kind.PAUSE:
                if st == S.PAUSED:
                    fut.set_result(self._last_step)
                    continue
                self._pending[Kind.PAUSE] = req
                self._leave(D.PAUSE)
                return
            if kind == Kind.RESUME:
                if st != S.PAUSED:
                    fut.set_exception(RuntimeError(f"cannot resume: the job is {st}, not paused"))
                    continue
                if req.n:
                    self._target = req.n
                self._pending[Kind.RESIZE] = req  # done (event "resumed") at the first step of its generation
                self._start_generation()
                return
            if st != S.RUNNING:
                fut.set_exception(RuntimeError(f"cannot {kind}: the job is {st}"))
                continue
            if kind == Kind.SET_BATCH:
                req.step = self._last_step
                self._pending[Kind.SET_BATCH] = req
                self._send_rank0(M.Command.SET_BATCH, req.batch.global_batch, req.batch.accum_steps)
            elif kind == Kind.CHECKPOINT:
                req.min_step = self._last_step + 1
                self._pending[Kind.CHECKPOINT] = req
                self._send_rank0(M.Command.CHECKPOINT)

    def _fail_pending(self, exc: Exception) -> None:
        """Every request under way or still queued raises ``exc`` (the job ended)."""
        for req in list(self._pending.values()):
            if not req.future.done():
                req.future.set_exception(exc)
        self._pending.clear()
        while True:
            try:
                req = self._requests.get_nowait()
            except queue.Empty:
                break
            if not req.future.done():
                req.future.set_exception(exc)
