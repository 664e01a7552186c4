"""ElasticJob: the controller of a local elastic DDP job, run from a notebook or a script.

The controller lives in the caller's process as one background thread; it never blocks the caller
(every request returns a :class:`concurrent.futures.Future`) and installs no signal handler. It keeps a
pool of long-lived worker processes (:func:`elasticlab.elastic.worker.pool_worker`, forked from a
forkserver that has imported torch once, or spawned), and runs the job as a sequence of
*generations*: one process group of a given size on a fresh c10d ``TCPStore`` (bound by the controller
to a fresh OS-chosen port on 127.0.0.1).

A resize, pause or stop is relayed to rank 0, which puts it into the all-reduce that ends every step;
at that step boundary rank 0 checkpoints (atomically), every rank leaves the group, and the controller
forms the next generation from the newest valid checkpoint. A dead worker is a fault: the survivors'
collectives fail (or time out and are killed), a replacement process is started, and the job resumes
from the newest valid checkpoint, losing at most the steps since then (reported in ``events()``).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import multiprocessing as mp
import os
import queue
import tempfile
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

from elasticlab.elastic.checkpoint import CheckpointDir
from elasticlab.elastic.policies import BatchConfig, FixedGlobalBatch
from elasticlab.elastic.records import EventLog, RecordLog, step_time_rows
from elasticlab.elastic.task import entrypoint_name
from elasticlab.elastic.worker import CMD_CHECKPOINT, CMD_LEAVE, CMD_SET_BATCH, default_options, pool_worker

TERMINAL = ("finished", "stopped", "failed")


def default_slots(device: str | None = None) -> int:
    """Worker slots here: one per GPU, else two per CPU core (gloo tolerates 2x oversubscription)."""
    try:
        import torch

        if torch.cuda.is_available() and device != "cpu":
            return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        pass
    return 2 * (os.cpu_count() or 1)


def _worker_context(start_method: str):
    """The multiprocessing context for worker processes. ``forkserver`` (default) imports torch once in
    the server and forks each worker from it (~0.1 s instead of seconds per worker); the server never
    starts torch's thread pools, so forking it is safe. ``spawn`` starts each worker from scratch."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "elasticlab.gns.ddp",
                                    "elasticlab.lr", "elasticlab.elastic.worker"])
    return ctx


def parse_schedule(schedule) -> dict[int, int]:
    """``{step: n}`` or ``"STEP:N,STEP:N"``: from step STEP+1 on, the job runs on N workers."""
    if not schedule:
        return {}
    if isinstance(schedule, str):
        out = {}
        for part in schedule.split(","):
            step, sep, n = part.strip().partition(":")
            if not sep or not step.strip().isdigit() or not n.strip().isdigit():
                raise ValueError(f"bad schedule entry {part!r}: expected STEP:N with integers, e.g. '20:3'")
            out[int(step)] = int(n)
        return out
    out = {}
    for k, v in dict(schedule).items():
        if int(k) != k or k < 1:
            raise ValueError(f"schedule steps must be positive integers, got {k!r}")
        out[int(k)] = v
    return out


class _Worker:
    __slots__ = ("id", "proc", "conn", "state", "pid", "rank")

    def __init__(self, wid, proc, conn):
        self.id, self.proc, self.conn = wid, proc, conn
        self.state, self.pid, self.rank = "starting", proc.pid, None


class ElasticJob:
    """A local elastic data-parallel job. See the module docstring.

    ``entrypoint`` names an importable function returning a :class:`~elasticlab.elastic.task.Task`
    (``"pkg.mod:make_task"``, ``"script.py:make_task"`` or the function itself). ``policy`` is a batch
    policy from :mod:`elasticlab.elastic.policies` (default: fixed global batch = the task's base
    batch, passed as ``global_batch``). ``record_samples`` = True or a path writes the JSONL sample
    record (rows ``{"epoch", "step", "rank", "world_size", "indices", "generation"}``).
    """

    def __init__(self, entrypoint, *, workers: int = 1, entry_kwargs: dict | None = None, policy=None,
                 global_batch: int | None = None, epochs: int = 1, max_steps: int | None = None,
                 slots: int | None = None, warm: int | None = None, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 20, record_samples: bool | str = False, seed: int = 0,
                 timeout_s: float = 30.0, threads: int = 1, lr_rule: str | None = None,
                 step_delay_s: float = 0.0, goodput_refit_s: float = 10.0, schedule=None,
                 start_method: str = "forkserver", device: str | None = None):
        self.entrypoint = entrypoint_name(entrypoint)
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be None (CUDA when available), 'cpu' or 'cuda', got {device!r}")
        self.slots = int(slots) if slots is not None else default_slots(device)
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots!r}")
        self._check_size(workers)
        if epochs is None or epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs!r}")
        if checkpoint_every is not None and checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every!r}")
        self.entry_kwargs = dict(entry_kwargs or {})
        self.policy = policy if policy is not None else (
            FixedGlobalBatch(global_batch) if global_batch is not None else None)
        self._tmp = None
        if checkpoint_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="elasticlab-job-")
            checkpoint_dir = self._tmp.name
        self.checkpoint_dir = CheckpointDir(checkpoint_dir)
        if record_samples is True:
            record_samples = str(Path(checkpoint_dir) / "samples.jsonl")
        self.record_path = str(record_samples) if record_samples else None
        self.warm = max(int(warm if warm is not None else workers), workers)
        if self.warm > self.slots:
            raise ValueError(f"warm={warm!r} exceeds the machine's {self.slots} slots")
        rule = lr_rule or getattr(self.policy, "lr_rule", "constant")
        self.options = default_options(seed=seed, lr_rule=rule, epochs=int(epochs), max_steps=max_steps,
                                       checkpoint_every=int(checkpoint_every or 0),
                                       timeout_s=float(timeout_s),
                                       threads=int(threads), record_samples=bool(self.record_path),
                                       step_delay_s=float(step_delay_s),
                                       ramp_per_k=getattr(self.policy, "ramp_per_k", 8), device=device)
        self.schedule = parse_schedule(schedule)
        for n in self.schedule.values():
            self._check_size(n)
        self.options["schedule"] = self.schedule
        self._target = int(workers)
        self._ctx = _worker_context(start_method)
        self._lock = threading.RLock()
        self._requests: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._workers: dict[int, _Worker] = {}
        self._next_id = 0
        self._active: list[_Worker] = []
        self._state = "new"
        self._gen = 0
        self._store = None
        self._drain_reason = None
        self._drain_deadline = None
        self._pending: dict = {}  # kind -> (future, info)
        self._last_step = 0
        self._last_rec: dict | None = None
        self._epoch = 0
        self._batch: BatchConfig | None = None
        self._lost_steps = 0
        self._thread: threading.Thread | None = None
        self._metrics = RecordLog()
        self._events = EventLog()
        self._record_file = None
        self._throughput = None
        self._predicted_goodput = None
        self._refit_every_s = float(goodput_refit_s)
        self._next_refit = 0.0
        self._fit_thread: threading.Thread | None = None
        self._error: str | None = None

    # ---- public API ---------------------------------------------------------------------------
    def start(self) -> ElasticJob:
        """Start the worker processes and the controller thread; returns at once."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"job already started (state {self._state!r})")
            self._state = "starting"
        if self.record_path:
            self._record_file = open(self.record_path, "a")  # noqa: SIM115 - closed by the controller
        self._events.emit("start", workers=self._target, slots=self.slots, entrypoint=self.entrypoint)
        self._thread = threading.Thread(target=self._loop, name="elasticlab-job", daemon=True)
        self._thread.start()
        return self

    def resize(self, n: int, *, global_batch: int | None = None, accum_steps: int | None = None) -> Future:
        """Re-form the job at ``n`` workers at the next step boundary (optionally with a new batch).

        The future's result is ``{"world_size", "step", "latency_s"}`` once the first step at the new
        size is done (latency = request to that step)."""
        self._check_size(n)
        batch = self._check_batch(global_batch, accum_steps)
        return self._request("resize", n=int(n), batch=batch)

    def set_batch(self, global_batch: int | None = None, *, per_worker_batch: int | None = None,
                  accum_steps: int | None = None) -> Future:
        """Change the global batch (or the per-worker batch) from the next step boundary on."""
        if per_worker_batch is not None:
            if global_batch is not None:
                raise ValueError("give global_batch or per_worker_batch, not both")
            if int(per_worker_batch) != per_worker_batch or per_worker_batch < 1:
                raise ValueError(f"per_worker_batch must be a positive integer, got {per_worker_batch!r}")
            global_batch = int(per_worker_batch) * self.world_size * ((accum_steps or 0) + 1)
        batch = self._check_batch(global_batch, accum_steps)
        if batch is None:
            raise ValueError("set_batch needs global_batch, per_worker_batch or accum_steps")
        return self._request("set_batch", batch=batch)

    def checkpoint(self) -> Future:
        """Checkpoint at the next step boundary; the result is the checkpoint's step."""
        return self._request("checkpoint")

    def pause(self) -> Future:
        """Checkpoint at the next step boundary and leave the group; the processes stay warm."""
        return self._request("pause")

    def resume(self, n: int | None = None) -> Future:
        """Resume a paused job (at ``n`` workers, default the size it had)."""
        if n is not None:
            self._check_size(n)
        return self._request("resume", n=n)

    def stop(self, timeout: float = 60.0) -> None:
        """Checkpoint at the next step boundary, end the worker processes and the controller thread."""
        with self._lock:
            if self._state == "new":
                self._state = "stopped"
                return
        if self._thread is None or not self._thread.is_alive():
            self._shutdown_workers()
            return
        self._request("stop", _allow_stopped=True)
        self._thread.join(timeout)
        if self._thread.is_alive():  # the controller is stuck: end the processes the hard way
            self._kill_all()
            self._thread.join(5)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finished, stopped or failed; True unless the timeout passed."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.state not in TERMINAL:
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.05)
        if self._thread is not None:
            self._thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return True

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    @property
    def world_size(self) -> int:
        with self._lock:
            return len(self._active) if self._active else self._target

    def status(self) -> dict:
        """A cheap snapshot: state, world size, step, epoch, batch, generation, workers, checkpoint."""
        with self._lock:
            rec = self._last_rec or {}
            b = self._batch
            return {"state": self._state, "world_size": len(self._active), "target_world_size": self._target,
                    "slots": self.slots, "generation": self._gen, "step": self._last_step,
                    "epoch": rec.get("epoch", 0), "loss": rec.get("loss"),
                    "samples_per_s": rec.get("samples_per_s"),
                    "global_batch": b.global_batch if b else None,
                    "accum_steps": b.accum_steps if b else None,
                    "per_worker_batch": b.per_worker_batch(max(1, len(self._active))) if b else None,
                    "gns": rec.get("gns"), "predicted_goodput": self._predicted_goodput,
                    "workers": {w.id: {"pid": w.pid, "state": w.state, "rank": w.rank}
                                for w in self._workers.values()},
                    "lost_steps": self._lost_steps, "error": self._error,
                    "checkpoint_dir": str(self.checkpoint_dir.directory), "record_samples": self.record_path}

    def metrics(self, since: int = 0) -> list[dict]:
        """Per-step records from index ``since`` on (keys: :data:`records.METRIC_KEYS`)."""
        return self._metrics.since(since)

    def events(self, since: int = 0) -> list[dict]:
        """Events (resizes, restarts, checkpoints, faults, ...) with their times, from index ``since``."""
        return self._events.since(since)

    def step_times(self, skip_first: int = 1, aggregate: bool = False) -> list[tuple]:
        """Measured ``(nodes, gpus, per_gpu_batch, accum_steps, iter_time)`` rows for a throughput model
        fit (Pollux §4.1); the first ``skip_first`` steps of each generation (warm-up) and epoch-tail
        steps are left out. ``aggregate=True`` gives one row per configuration (median time)."""
        return step_time_rows(self._metrics.since(0), skip_first, aggregate)

    def worker_pids(self) -> dict[int, int]:
        """``{rank: pid}`` of the current generation (e.g. to inject a fault)."""
        with self._lock:
            return {w.rank: w.pid for w in self._active}

    def __enter__(self):
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc):
        self.stop()

    # ---- request plumbing ---------------------------------------------------------------------
    def _check_size(self, n) -> None:
        if isinstance(n, bool) or not isinstance(n, (int,)) and not (hasattr(n, "__index__")):
            raise ValueError(f"world size must be an integer, got {n!r}")
        n = int(n)
        if n < 1:
            raise ValueError(f"world size must be >= 1, got {n}")
        if n > self.slots:
            raise ValueError(f"world size {n} exceeds the machine's {self.slots} worker slots")

    def _check_batch(self, global_batch, accum_steps) -> BatchConfig | None:
        if global_batch is None and accum_steps is None:
            return None
        if global_batch is not None and (int(global_batch) != global_batch or global_batch < 1):
            raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
        if accum_steps is not None and (int(accum_steps) != accum_steps or accum_steps < 0):
            raise ValueError(f"accum_steps must be a non-negative integer, got {accum_steps!r}")
        if global_batch is None:
            with self._lock:
                global_batch = self._batch.global_batch if self._batch else self._base_batch()
        return BatchConfig(int(global_batch), int(accum_steps or 0))

    def _request(self, kind: str, _allow_stopped: bool = False, **info) -> Future:
        with self._lock:
            if self._state in TERMINAL and not _allow_stopped:
                raise RuntimeError(f"cannot {kind}: the job is {self._state}")
            if self._state == "new" and kind != "stop":
                if kind == "resize":
                    self._target = info["n"]
                    f = Future()
                    f.set_result({"world_size": info["n"], "step": 0, "latency_s": 0.0})
                    return f
                raise RuntimeError(f"cannot {kind}: the job has not been started")
        fut: Future = Future()
        self._requests.put((kind, info, fut, time.perf_counter()))
        with contextlib.suppress(Exception):
            self._wake_w.send(None)
        return fut

    # ---- the controller thread ----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._spawn_upto(self.warm)
            import torch.distributed  # noqa: F401  (the controller hosts each generation's TCPStore)
            while True:
                objs = [self._wake_r]
                for w in list(self._workers.values()):
                    if w.state != "dead":
                        objs += [w.conn, w.proc.sentinel]
                ready = mp_wait(objs, timeout=0.25)
                for obj in ready:
                    if obj is self._wake_r:
                        while self._wake_r.poll():
                            self._wake_r.recv()
                        continue
                    for w in list(self._workers.values()):
                        if obj is w.conn:
                            self._drain_conn(w)
                        elif obj == w.proc.sentinel and w.state != "dead":
                            self._drain_conn(w)
                            self._on_death(w)
                if self._record_file is not None:
                    self._record_file.flush()
                self._advance()
                if self._state in TERMINAL:
                    break
        except Exception as e:  # never leave processes behind because of a controller bug
            self._error = f"controller failed: {e!r}"
            self._events.emit("error", message=self._error)
            with self._lock:
                self._state = "failed"
        finally:
            self._kill_all()
            self._fail_pending(RuntimeError(f"the job is {self._state}"))
            if self._record_file is not None:
                self._record_file.close()
                self._record_file = None

    def _spawn_upto(self, n: int) -> None:
        alive = [w for w in self._workers.values() if w.state != "dead"]
        for _ in range(n - len(alive)):
            parent, child = self._ctx.Pipe()
            wid = self._next_id
            self._next_id += 1
            proc = self._ctx.Process(target=pool_worker, name=f"elasticlab-worker-{wid}", daemon=True,
                                     args=(child, wid, self.entrypoint, self.entry_kwargs, self.options))
            proc.start()
            child.close()
            with self._lock:
                self._workers[wid] = _Worker(wid, proc, parent)

    def _drain_conn(self, w: _Worker) -> None:
        try:
            while w.conn.poll():
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    def _on_message(self, w: _Worker, msg) -> None:
        kind = msg[0]
        if kind == "ready":
            w.state = "idle"
            w.pid = msg[2]
            self._events.emit("ready", worker=w.id, pid=w.pid)
        elif kind == "step":
            self._on_step(msg[1])
        elif kind == "samples":
            if self._record_file is not None:
                self._record_file.write(json.dumps(msg[1]) + "\n")
        elif kind == "checkpoint":
            _, gen, step, path, probe, why = msg
            self._events.emit("checkpoint", generation=gen, step=step, path=path, probe_loss=probe,
                              reason=why)
            self._resolve("checkpoint", lambda info: step >= info.get("min_step", 0), step)
        elif kind == "resumed":
            _, gen, step, probe, ckpt = msg
            self._events.emit("resume", generation=gen, step=step, probe_loss=probe, checkpoint=ckpt,
                              world_size=len(self._active))
        elif kind == "schedule":  # rank 0 leaves at a scheduled step; re-form at the scheduled size
            _, gen, step, n = msg
            if self._state == "running" and gen == self._gen:
                self._target = n
                self._pending["resize"] = (Future(), {"n": n, "from": len(self._active), "batch": None,
                                                      "t_request": time.perf_counter(), "scheduled": step})
                with self._lock:
                    self._state, self._drain_reason, self._drain_deadline = "draining", "resize", None
        elif kind == "left":
            pass
        elif kind == "finished":
            _, gen, step, path, probe = msg
            self._events.emit("checkpoint", generation=gen, step=step, path=path, probe_loss=probe,
                              reason="final")
            self._events.emit("finished", generation=gen, step=step)
            with self._lock:
                self._state, self._drain_reason, self._drain_deadline = "draining", "finished", None
        elif kind == "idle":
            if w.state != "dead":
                w.state, w.rank = "idle", None
        elif kind == "error":
            _, wid, gen, text = msg
            self._events.emit("error", worker=wid, generation=gen, message=text)
            if gen is None:  # the task could not even be built: nothing will work
                self._error = text
                with self._lock:
                    self._state = "failed"

    def _on_step(self, rec: dict) -> None:
        rec["predicted_goodput"] = self._predicted_goodput
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
        from elasticlab.elastic.policies import GoodputAdaptive

        if not isinstance(self.policy, GoodputAdaptive) or self.state != "running":
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
                self._request("set_batch", batch=choice)

    def _base_batch(self) -> int:
        pol = self.policy
        if pol is not None and hasattr(pol, "initial_global_batch"):
            return int(pol.initial_global_batch())
        return int(self._batch.global_batch) if self._batch else 1

    def _resolve(self, kind, pred, value) -> None:
        p = self._pending.get(kind)
        if p and pred(p[1]):
            del self._pending[kind]
            p[0].set_result(value)

    def _on_death(self, w: _Worker) -> None:
        was = w.state
        w.state = "dead"
        w.proc.join(2.0)  # the sentinel can fire just before the exit status is there to collect
        code = w.proc.exitcode
        with contextlib.suppress(Exception):
            w.conn.close()
        if self._state in ("stopping", "stopped"):
            return
        self._events.emit("fault", worker=w.id, pid=w.pid, exitcode=code, rank=w.rank, was=was,
                          generation=self._gen, step=self._last_step)
        if was == "active" and self._state in ("running", "draining"):
            p = self._pending.pop("checkpoint", None)
            if p and not p[0].done():
                p[0].set_exception(RuntimeError(f"worker {w.id} died before the requested checkpoint"))
            with self._lock:
                self._state = "draining"
                self._drain_reason = self._drain_reason if self._drain_reason in ("stop", "finished") \
                    else "fault"
                self._drain_deadline = time.monotonic() + self.options["timeout_s"] + 5
        elif was == "starting" and not any(x.state in ("idle", "active") for x in self._workers.values()):
            self._error = f"worker {w.id} died while starting (exit code {code})"

    # ---- state machine -------------------------------------------------------------------------
    def _advance(self) -> None:
        st = self._state
        if st == "failed":
            return
        if st == "starting":
            idle = [w for w in self._workers.values() if w.state == "idle"]
            if len(idle) >= self._target:  # a checkpoint directory from an earlier run is resumed
                self._form(self._target, *self._resume_from())
            elif self._error:
                with self._lock:
                    self._state = "failed"
            return
        if st == "running":
            self._take_requests()
            return
        if st == "draining":
            self._check_drained()
            return
        if st == "spawning":
            idle = [w for w in self._workers.values() if w.state == "idle"]
            if len(idle) >= self._target:
                self._form(self._target, *self._resume_from())
            else:  # replace any that died while starting
                self._spawn_upto(self._target)
            return
        if st == "paused":
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
                if st == "running":
                    self._leave("stop")
                else:
                    self._finish("stopped")
                return
            if kind == "resize":
                if st == "paused":
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
                if st == "paused":
                    fut.set_result(self._last_step)
                    continue
                self._pending["pause"] = (fut, info)
                self._leave("pause")
                return
            if kind == "resume":
                if st != "paused":
                    fut.set_exception(RuntimeError(f"cannot resume: the job is {st}, not paused"))
                    continue
                if info.get("n"):
                    self._target = info["n"]
                info["from"] = 0
                self._pending["resize"] = (fut, info)
                self._start_generation()
                return
            if st != "running":
                fut.set_exception(RuntimeError(f"cannot {kind}: the job is {st}"))
                continue
            if kind == "set_batch":
                b = info["batch"]
                info["step"] = self._last_step
                self._pending["set_batch"] = (fut, info)
                self._send_rank0((CMD_SET_BATCH, b.global_batch, b.accum_steps))
            elif kind == "checkpoint":
                info["min_step"] = self._last_step + 1
                self._pending["checkpoint"] = (fut, info)
                self._send_rank0((CMD_CHECKPOINT, 0, 0))

    def _send_rank0(self, control) -> None:
        r0 = next((w for w in self._active if w.rank == 0), None)
        if r0 is not None:
            with contextlib.suppress(Exception):  # tagged: a generation ignores its predecessors' leftovers
                r0.conn.send(("ctl", self._gen, *control))

    def _leave(self, reason: str) -> None:
        with self._lock:
            self._state = "draining"
            self._drain_reason = reason
            self._drain_deadline = None
        self._send_rank0((CMD_LEAVE, 0, 0))

    def _check_drained(self) -> None:
        busy = [w for w in self._active if w.state == "active"]
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
            self._finish("finished")
        elif reason == "stop":
            self._finish("stopped")
        elif reason == "pause":
            with self._lock:
                self._state = "paused"
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
        idle = [w for w in self._workers.values() if w.state == "idle"]
        if len(idle) < self._target:
            self._spawn_upto(self._target)
            with self._lock:
                self._state = "spawning"
            return
        self._form(self._target, *self._resume_from())

    def _resume_from(self):
        path, bad = self.checkpoint_dir.latest()
        for p, why in bad:
            self._events.emit("checkpoint_corrupt", path=str(p), reason=why)
        return (str(path) if path else None), bad

    def _form(self, n: int, checkpoint: str | None, bad=None) -> None:
        import torch.distributed as dist

        idle = sorted((w for w in self._workers.values() if w.state == "idle"), key=lambda w: w.id)
        members = idle[:n]
        self._close_store()
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.options["timeout_s"]))
        with self._lock:
            self._gen += 1
            gen = self._gen
        batch = self._decide_batch(n)
        ck_step = int(Path(checkpoint).stem.split("-")[1]) if checkpoint else 0
        for rank, w in enumerate(members):
            w.state, w.rank = "active", rank
            w.conn.send(("join", {"generation": gen, "rank": rank, "world_size": n, "port": self._store.port,
                                  "checkpoint": checkpoint,
                                  "checkpoint_dir": str(self.checkpoint_dir.directory),
                                  "batch": (batch.global_batch, batch.accum_steps) if batch else None}))
        with self._lock:
            self._active = members
            self._state = "running"
        self._events.emit("generation", generation=gen, world_size=n, port=self._store.port,
                          checkpoint=checkpoint, from_step=ck_step,
                          workers=[w.id for w in members])
        if getattr(self, "_restart_pending", False):
            self._restart_pending = False
            lost = max(0, self._last_step - ck_step)
            self._lost_steps += lost
            self._events.emit("restart", generation=gen, from_step=ck_step, last_step=self._last_step,
                              lost_steps=lost, world_size=n)
        p = self._pending.pop("resize", None)
        if p:
            p[1]["generation"] = gen
            self._pending["resize_done"] = p

    def _decide_batch(self, n: int) -> BatchConfig | None:
        p = self._pending.get("resize")
        if p and p[1].get("batch") is not None:
            return p[1]["batch"]
        p = self._pending.get("set_batch")  # asked for, but the generation ended before it took effect
        if p:
            return p[1]["batch"]
        if self.policy is None:
            return self._batch
        stats = {"current": self._batch, "throughput_model": self._throughput,
                 "gns": (self._last_rec or {}).get("gns")}
        try:
            return self.policy.decide(n, stats)
        except Exception as e:
            self._events.emit("error", message=f"batch policy failed, batch kept: {e!r}")
            return self._batch

    def _close_store(self) -> None:
        if self._store is not None:
            self._store = None  # dropping the master store closes its listening port

    def _finish(self, state: str) -> None:
        self._shutdown_workers()
        with self._lock:
            self._state = state
            self._active = []
        if state == "stopped":
            self._events.emit("stop", step=self._last_step)
        p = self._pending.pop("stop", None)
        if p:
            p[0].set_result(self._last_step)

    def _shutdown_workers(self, timeout: float = 10.0) -> None:
        for w in self._workers.values():
            if w.state != "dead":
                with contextlib.suppress(Exception):
                    w.conn.send(("exit",))
        end = time.monotonic() + timeout
        for w in self._workers.values():
            w.proc.join(max(0.0, end - time.monotonic()))
        self._kill_all()

    def _kill_all(self) -> None:
        for w in list(self._workers.values()):
            if w.proc.is_alive():
                with contextlib.suppress(Exception):
                    w.proc.kill()
                w.proc.join(5)
            w.state = "dead"

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
