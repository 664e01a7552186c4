"""The controller thread of an :class:`~elasticlab.elastic.ElasticJob`: it serves the worker pool's
messages, takes the caller's requests at step boundaries, and forms each generation.

:class:`JobController` is the base of :class:`~elasticlab.elastic.ElasticJob`, which adds the public API
and queues requests as ``(kind, info, future, t_request)``. Every state change goes through
:meth:`JobController._set_state`, which checks it against :data:`~elasticlab.elastic.states.TRANSITIONS`.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import queue
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

from elasticlab.elastic import messages as M
from elasticlab.elastic.messages import CMD_CHECKPOINT, CMD_LEAVE, CMD_SET_BATCH
from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.pool import PoolWorker, WorkerPool
from elasticlab.elastic.records import EventLog, RecordLog
from elasticlab.elastic.states import TERMINAL, JobState, WorkerState, check_transition

S, W = JobState, WorkerState

#: How long a worker exception waits for a peer's death that would explain it (seconds).
FAILURE_SETTLE_S = 0.5


class JobController:
    """The controller's state and thread (see the module docstring)."""

    def __init__(self, start_method: str):
        self._lock = threading.RLock()
        self._pool = WorkerPool(start_method, self.entrypoint, self.entry_kwargs, self.options, self._lock)
        self._requests: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._active: list[PoolWorker] = []
        self._state = S.NEW
        self._gen = 0
        self._store = None
        self._drain_reason = None
        self._drain_deadline = None
        self._restart_pending = False  # the next generation replaces one lost to a fault
        self._pending: dict = {}  # kind -> (future, info)
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
        self._error: str | None = None
        self._traceback: str | None = None
        self._rejected: set[str] = set()  # checkpoints that verified but did not load
        self._replays = 0  # formations that rolled the job back (lost_steps > 0)
        self._restarts = 0  # task errors retried under max_restarts
        self._high_water = 0  # the furthest step the job reached
        self._failed_gens = 0  # generations in a row that ended in a fault without passing _high_water
        self._aborted_gen = 0  # the last generation abandoned (counted once)
        self._death_gens: set[int] = set()  # generations in which a member died
        self._pending_failure = None  # (decide at, generation, error, traceback) of a worker exception

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
            if self._record_file is not None:
                self._record_file.write(json.dumps(msg.row) + "\n")
        elif isinstance(msg, M.Checkpointed):
            self._rejected.discard(msg.path)  # written anew: no longer the file that did not load
            self._events.emit("checkpoint", generation=msg.generation, step=msg.step, path=msg.path,
                              probe_loss=msg.probe_loss, reason=msg.reason)
            self._resolve("checkpoint", lambda info: msg.step >= info.get("min_step", 0), msg.step)
        elif isinstance(msg, M.Resumed):
            self._events.emit("resume", generation=msg.generation, step=msg.step, probe_loss=msg.probe_loss,
                              checkpoint=msg.checkpoint, world_size=len(self._active), formed_s=msg.formed_s)
        elif isinstance(msg, M.Scheduled):  # rank 0 leaves at a scheduled step; re-form at the scheduled size
            if self._state == S.RUNNING and msg.generation == self._gen:
                self._target = msg.world_size
                self._pending["resize"] = (Future(), {"n": msg.world_size, "from": len(self._active),
                                                      "batch": None, "t_request": time.perf_counter(),
                                                      "scheduled": msg.step})
                self._drain("resize")
        elif isinstance(msg, M.Left):
            pass
        elif isinstance(msg, M.Finished):
            self._rejected.discard(msg.path)
            self._events.emit("checkpoint", generation=msg.generation, step=msg.step, path=msg.path,
                              probe_loss=msg.probe_loss, reason="final")
            self._events.emit("finished", generation=msg.generation, step=msg.step)
            self._drain("finished")
        elif isinstance(msg, M.Idle):
            if w.state != W.DEAD:
                w.state, w.rank = W.IDLE, None
        elif isinstance(msg, M.Error):
            self._on_error(w, msg)

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
                self._pending_failure = (time.monotonic() + FAILURE_SETTLE_S, msg.generation,
                                         f"{msg.kind} error on {where}: {msg.text}", msg.traceback)

    def _settle_failure(self) -> None:
        """Fail the job for a worker exception, unless a member of its generation died meanwhile (then the
        error was the death's echo in a collective, and the generation is re-formed as for any fault)."""
        due, gen, error, tb = self._pending_failure
        dead = [w for w in self._active if not w.proc.is_alive()] if gen == self._gen else []
        if gen in self._death_gens or dead:
            self._pending_failure = None
            self._events.emit("error_explained", generation=gen, message=error,
                              reason="a member of the generation died")
            return
        if time.monotonic() >= due:
            self._pending_failure = None
            self._fail(error, tb)

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
        p = self._pending.pop("checkpoint", None)
        if p and not p[0].done():
            p[0].set_exception(RuntimeError(f"generation {gen} was abandoned before the checkpoint: {why}"))
        with self._lock:
            reason = self._drain_reason if (self._state == S.DRAINING and self._drain_reason in (
                "stop", "finished", "pause")) else "fault"
            self._drain(reason, time.monotonic() + float(self.options.get("abort_grace_s", 3.0)))

    def _on_step(self, rec: dict) -> None:
        rec["predicted_goodput"] = self._predicted_goodput
        if rec["step"] > self._high_water:
            self._high_water, self._failed_gens = rec["step"], 0
        with self._lock:
            self._last_step, self._last_rec = rec["step"], rec
            self._batch = BatchConfig(rec["global_batch"], rec["accum_steps"])
        self._metrics.append(rec)
        now = time.perf_counter()
        p = self._pending.get("resize_done")
        if p and rec["generation"] == p[1]["generation"]:
            del self._pending["resize_done"]
            res = {"world_size": rec["world_size"], "step": rec["step"], "latency_s": now - p[1]["t_request"]}
            self._events.emit("resize", from_size=p[1]["from"], to_size=rec["world_size"], step=rec["step"],
                              latency_s=res["latency_s"])
            p[0].set_result(res)
        p = self._pending.get("set_batch")
        if p and rec["step"] > p[1]["step"] and rec["global_batch"] == p[1]["batch"].global_batch \
                and rec["accum_steps"] == p[1]["batch"].accum_steps:
            del self._pending["set_batch"]
            self._events.emit("set_batch", step=rec["step"], global_batch=rec["global_batch"],
                              accum_steps=rec["accum_steps"])
            p[0].set_result({"step": rec["step"], "global_batch": rec["global_batch"],
                             "accum_steps": rec["accum_steps"]})
        self._maybe_refit(rec)

    def _resolve(self, kind, pred, value) -> None:
        p = self._pending.get(kind)
        if p and pred(p[1]):
            del self._pending[kind]
            p[0].set_result(value)

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
        while True:
            try:
                kind, info, fut, t = self._requests.get_nowait()
            except queue.Empty:
                return
            info["t_request"] = t
            st = self._state
            if kind == "stop":
                self._pending["stop"] = (fut, info)
                if st == S.RUNNING:
                    self._leave("stop")
                else:
                    self._finish(S.STOPPED)
                return
            if kind == "resize":
                if st == S.PAUSED:
                    self._target = info["n"]
                    fut.set_result({"world_size": info["n"], "step": self._last_step, "latency_s": 0.0})
                    continue
                if info["n"] == len(self._active) and info["batch"] is None:
                    fut.set_result({"world_size": info["n"], "step": self._last_step, "latency_s": 0.0})
                    continue
                self._target = info["n"]
                info["from"] = len(self._active)
                self._pending["resize"] = (fut, info)
                self._leave("resize")
                return
            if kind == "pause":
                if st == S.PAUSED:
                    fut.set_result(self._last_step)
                    continue
                self._pending["pause"] = (fut, info)
                self._leave("pause")
                return
            if kind == "resume":
                if st != S.PAUSED:
                    fut.set_exception(RuntimeError(f"cannot resume: the job is {st}, not paused"))
                    continue
                if info.get("n"):
                    self._target = info["n"]
                info["from"] = 0
                self._pending["resize"] = (fut, info)
                self._start_generation()
                return
            if st != S.RUNNING:
                fut.set_exception(RuntimeError(f"cannot {kind}: the job is {st}"))
                continue
            if kind == "set_batch":
                b = info["batch"]
                info["step"] = self._last_step
                self._pending["set_batch"] = (fut, info)
                self._send_rank0(CMD_SET_BATCH, b.global_batch, b.accum_steps)
            elif kind == "checkpoint":
                info["min_step"] = self._last_step + 1
                self._pending["checkpoint"] = (fut, info)
                self._send_rank0(CMD_CHECKPOINT)

    def _send_rank0(self, command: M.Command, global_batch: int = 0, accum_steps: int = 0) -> None:
        r0 = next((w for w in self._active if w.rank == 0), None)
        if r0 is not None:
            with contextlib.suppress(Exception):  # tagged: a generation ignores its predecessors' leftovers
                r0.conn.send(M.Control(self._gen, command, global_batch, accum_steps))

    def _drain(self, reason: str, deadline: float | None = None) -> None:
        """The generation leaves its group (because of ``reason``); kill what is left after ``deadline``."""
        with self._lock:
            self._set_state(S.DRAINING)
            self._drain_reason, self._drain_deadline = reason, deadline

    def _leave(self, reason: str) -> None:
        self._drain(reason)
        self._send_rank0(CMD_LEAVE)

    def _check_drained(self) -> None:
        if self._pending_failure is not None:  # the job may be failing: form nothing new meanwhile
            return
        busy = [w for w in self._active if w.state == W.ACTIVE]
        if busy:
            if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                for w in busy:  # stuck in a collective with a dead peer: replace it
                    self._events.emit("fault", worker=w.id, pid=w.pid, reason="did not leave the group",
                                      generation=self._gen)
                    with contextlib.suppress(Exception):
                        w.proc.kill()
            return
        self._close_store()
        with self._lock:
            self._active = []
        reason = self._drain_reason
        if reason == "finished":
            self._finish(S.FINISHED)
        elif reason == "stop":
            self._finish(S.STOPPED)
        elif reason == "pause":
            self._set_state(S.PAUSED)
            self._events.emit("pause", step=self._last_step)
            p = self._pending.pop("pause", None)
            if p:
                p[0].set_result(self._last_step)
        elif reason == "fault":
            self._start_generation(restart=True)
        else:  # resize
            self._start_generation()

    def _start_generation(self, restart: bool = False) -> None:
        if restart:
            self._restart_pending = True
        if len(self._pool.idle()) < self._target:
            self._pool.spawn_upto(self._target)
            self._set_state(S.SPAWNING)
            return
        self._form(self._target)

    def _resume_from(self):
        path, bad = self.checkpoint_dir.latest(exclude=self._rejected)
        for p, why in bad:
            self._events.emit("checkpoint_corrupt", path=str(p), reason=why)
        return (str(path) if path else None), bad

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
        checkpoint, bad = self._resume_from()
        members = [w for w in self._pool.idle() if w.proc.is_alive()][:n]
        if len(members) < n:  # one died idle and its sentinel is not handled yet: spawn and come back
            self._pool.spawn_upto(self._target)
            self._set_state(S.SPAWNING)
            return
        if checkpoint is None and (bad or self._rejected or self._high_water > 0):
            what = ", ".join(sorted({str(p) for p, _ in bad} | self._rejected)) or "none was written"
            if self.options.get("on_no_checkpoint", "restart") == "fail":
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
                              lost_steps=lost, world_size=n, checkpoint=checkpoint)
            with self._lock:
                self._last_step = ck_step
        # a resize (or resume) is done at the first step of this generation -- also when the generation
        # first formed for it was abandoned
        p = self._pending.pop("resize", None) or self._pending.pop("resize_done", None)
        if p:
            p[1]["generation"] = gen
            self._pending["resize_done"] = p
        if gone:
            self._abort(f"worker(s) {gone} were gone before they could join generation {gen}")

    def _close_store(self) -> None:
        if self._store is not None:
            self._store = None  # dropping the master store closes its listening port

    def _finish(self, state: JobState) -> None:
        self._pool.shutdown()
        with self._lock:
            self._set_state(state)
            self._active = []
        if state == S.STOPPED:
            self._events.emit("stop", step=self._last_step)
        p = self._pending.pop("stop", None)
        if p:
            p[0].set_result(self._last_step)

    def _fail_pending(self, exc: Exception) -> None:
        for _, (fut, _) in list(self._pending.items()):
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()
        while True:
            try:
                _, _, fut, _ = self._requests.get_nowait()
            except queue.Empty:
                break
            if not fut.done():
                fut.set_exception(exc)
