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

This module holds the public API and the request checks. The controller thread is the base class
:class:`~.controller.JobController`; the batch and goodput decisions are
:class:`~.adaptation.BatchAdaptation`; the processes are a :class:`~.pool.WorkerPool`; the lifecycle is
:class:`~.states.JobState`.
"""
from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path

from elasticlab.checks import seconds, whole
from elasticlab.elastic.adaptation import BatchAdaptation
from elasticlab.elastic.checkpoint import CheckpointDir
from elasticlab.elastic.controller import JobController
from elasticlab.elastic.policies import BatchConfig, FixedGlobalBatch
from elasticlab.elastic.pool import default_slots
from elasticlab.elastic.records import StepTime, step_time_rows
from elasticlab.elastic.requests import Kind, Request
from elasticlab.elastic.states import TERMINAL, ElasticJobStatus, JobState, OnNoCheckpoint, wait_terminal
from elasticlab.elastic.task import entrypoint_name
from elasticlab.elastic.trainer import default_options

__all__ = ["ElasticJob", "JobState", "TERMINAL", "default_slots", "parse_schedule"]


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
            k = int(step)
            if k in out:
                raise ValueError(f"schedule step {k} is given twice ({k}:{out[k]} and {part.strip()}): "
                                 "give each step once")
            out[int(step)] = int(n)
        return out
    out = {}
    for k, v in dict(schedule).items():
        if int(k) != k or k < 1:
            raise ValueError(f"schedule steps must be positive integers, got {k!r}")
        out[int(k)] = v
    return out


class ElasticJob(BatchAdaptation, JobController):
    """A local elastic data-parallel job. See the module docstring.

    ``entrypoint`` names an importable function returning a :class:`~elasticlab.elastic.task.Task`
    (``"pkg.mod:make_task"``, ``"script.py:make_task"`` or the function itself). ``policy`` is a batch
    policy from :mod:`elasticlab.elastic.policies` (default: fixed global batch = the task's base
    batch, passed as ``global_batch``). ``record_samples`` = True or a path writes the JSONL sample
    record (rows ``{"epoch", "step", "rank", "world_size", "indices", "generation"}``).

    Failures (the full table is :class:`~elasticlab.elastic.states.JobState`'s docstring): an exception in
    a worker -- the task's code, writing a checkpoint -- fails the job within seconds, with the error and
    the worker's traceback in ``status()`` (``error``, ``traceback``), unless ``max_restarts`` (default 0)
    allows a restart from the newest valid checkpoint. A worker that dies is replaced and the job resumes
    from the newest valid checkpoint; a generation that cannot form or breaks is abandoned and formed
    again, and ``max_failed_generations`` (default 5) such generations in a row without progress fail the
    job. A checkpoint that does not load is passed over like a corrupt one; with none left every rank
    restarts from the initial state (the steps lost are counted) or, with ``on_no_checkpoint="fail"``, the
    job fails. ``store_host``: the address the rendezvous store listens on (default 127.0.0.1; the pool's
    workers are on this machine). ``abort_grace_s``: how long members of an abandoned generation get to
    leave before they are killed and replaced. ``inject_faults``: ``[(point, generation, rank), ...]`` where
    a worker SIGKILLs itself (fault-injection tests; points in :func:`~.worker._fault_point`).
    """

    def __init__(self, entrypoint, *, workers: int = 1, entry_kwargs: dict | None = None, policy=None,
                 global_batch: int | None = None, epochs: int = 1, max_steps: int | None = None,
                 slots: int | None = None, warm: int | None = None, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 20, record_samples: bool | str = False, seed: int = 0,
                 timeout_s: float = 30.0, threads: int = 1, lr_rule: str | None = None,
                 step_delay_s: float = 0.0, goodput_refit_s: float = 10.0, schedule=None,
                 start_method: str = "forkserver", device: str | None = None, max_restarts: int = 0,
                 max_failed_generations: int = 5, on_no_checkpoint: str = OnNoCheckpoint.RESTART,
                 store_host: str = "127.0.0.1", abort_grace_s: float = 3.0, inject_faults=None):
        self.entrypoint = entrypoint_name(entrypoint)
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be None (CUDA when available), 'cpu' or 'cuda', got {device!r}")
        self.slots = whole("slots", slots, 1) if slots is not None else default_slots(device)
        self._check_size(workers)
        epochs = whole("epochs", epochs, 1, ">= 1")
        checkpoint_every = whole("checkpoint_every", checkpoint_every or 0, 0, ">= 0")
        whole("max_restarts", max_restarts, 0, "a non-negative integer")
        whole("max_failed_generations", max_failed_generations, 1, "a positive integer")
        if on_no_checkpoint not in [p.value for p in OnNoCheckpoint]:
            raise ValueError(f"on_no_checkpoint must be one of {[p.value for p in OnNoCheckpoint]}, "
                             f"got {on_no_checkpoint!r}")
        if not isinstance(store_host, str) or not store_host:
            raise ValueError(f"store_host must be an address string such as '127.0.0.1', got {store_host!r}")
        seconds("abort_grace_s", abort_grace_s)
        seconds("timeout_s", timeout_s)
        seconds("step_delay_s", step_delay_s, zero_ok=True)
        seconds("goodput_refit_s", goodput_refit_s, zero_ok=True)
        whole("threads", threads, 1, "an integer >= 1")
        whole("seed", seed, 0)
        if entry_kwargs is not None and not isinstance(entry_kwargs, Mapping):
            raise ValueError(f"entry_kwargs must be a dict of the entrypoint's keyword arguments, got "
                             f"{type(entry_kwargs).__name__} {entry_kwargs!r:.60}")
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
        if self.record_path:
            rec = Path(self.record_path)
            if rec.is_dir():
                raise ValueError(f"record_samples {self.record_path!r} is a folder; name the JSONL file to "
                                 "write")
            if not rec.parent.is_dir():
                raise ValueError(f"record_samples {self.record_path!r}: the folder {str(rec.parent)!r} does "
                                 "not exist")
        if global_batch is not None:
            whole("global_batch", global_batch, 1, "a positive integer")
        if max_steps is not None:
            whole("max_steps", max_steps, 1, "a positive integer")
        self.schedule = parse_schedule(schedule)
        for step, n in self.schedule.items():  # before the warm check: name the schedule entry
            try:
                self._check_size(n)
            except ValueError as e:
                raise ValueError(f"schedule entry {step}:{n}: {e}") from None
        self.warm = max(whole("warm", warm, 1) if warm is not None else workers, workers)
        if self.warm > self.slots:
            raise ValueError(f"warm={warm!r} exceeds the machine's {self.slots} slots")
        rule = lr_rule or getattr(self.policy, "lr_rule", "constant")
        self.options = default_options(seed=seed, lr_rule=rule, epochs=epochs, max_steps=max_steps,
                                       checkpoint_every=checkpoint_every,
                                       timeout_s=float(timeout_s),
                                       threads=int(threads), record_samples=bool(self.record_path),
                                       step_delay_s=float(step_delay_s),
                                       ramp_per_k=getattr(self.policy, "ramp_per_k", 8), device=device,
                                       max_restarts=int(max_restarts),
                                       max_failed_generations=int(max_failed_generations),
                                       on_no_checkpoint=OnNoCheckpoint(on_no_checkpoint).value,
                                       store_host=store_host,
                                       abort_grace_s=float(abort_grace_s),
                                       inject_faults=[tuple(f) for f in inject_faults or ()])
        self.options["schedule"] = self.schedule
        self._target = int(workers)
        self._refit_every_s = float(goodput_refit_s)
        self._next_refit = 0.0
        self._fit_thread: threading.Thread | None = None
        super().__init__(start_method)

    # ---- public API ---------------------------------------------------------------------------
    def start(self) -> ElasticJob:
        """Start the worker processes and the controller thread; returns at once."""
        with self._lock:
            if self._state != JobState.NEW:
                raise RuntimeError(f"job already started (state {self._state.value!r})")
            self._set_state(JobState.STARTING)
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
        return self._request(Kind.RESIZE, n=int(n), batch=batch)

    def set_batch(self, global_batch: int | None = None, *, per_worker_batch: int | None = None,
                  accum_steps: int | None = None) -> Future:
        """Change the global batch (or the per-worker batch) from the next step boundary on."""
        if per_worker_batch is not None:
            if global_batch is not None:
                raise ValueError("give global_batch or per_worker_batch, not both")
            per_worker_batch = whole("per_worker_batch", per_worker_batch, 1, "a positive integer")
            global_batch = per_worker_batch * self.world_size * ((accum_steps or 0) + 1)
        batch = self._check_batch(global_batch, accum_steps)
        if batch is None:
            raise ValueError("set_batch needs global_batch, per_worker_batch or accum_steps")
        return self._request(Kind.SET_BATCH, batch=batch)

    def checkpoint(self) -> Future:
        """Checkpoint at the next step boundary; the result is the checkpoint's step."""
        return self._request(Kind.CHECKPOINT)

    def pause(self) -> Future:
        """Checkpoint at the next step boundary and leave the group; the processes stay warm."""
        return self._request(Kind.PAUSE)

    def resume(self, n: int | None = None) -> Future:
        """Resume a paused job (at ``n`` workers, default the size it had)."""
        if n is not None:
            self._check_size(n)
        return self._request(Kind.RESUME, n=n)

    def stop(self, timeout: float = 60.0) -> None:
        """Checkpoint at the next step boundary, end the worker processes and the controller thread."""
        with self._lock:
            if self._state == JobState.NEW:
                self._set_state(JobState.STOPPED)
                return
        if self._thread is None or not self._thread.is_alive():
            self._pool.shutdown()
            return
        self._request(Kind.STOP, _allow_stopped=True)
        self._thread.join(timeout)
        if self._thread.is_alive():  # the controller is stuck: end the processes the hard way
            self._pool.kill_all()
            self._thread.join(5)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finished, stopped or failed; True unless the timeout passed."""
        end = None if timeout is None else time.monotonic() + timeout
        if not wait_terminal(lambda: self.state, timeout):
            return False
        if self._thread is not None:
            self._thread.join(None if end is None else max(0.0, end - time.monotonic()))
        return True

    @property
    def state(self) -> str:
        with self._lock:
            return self._state.value

    @property
    def world_size(self) -> int:
        with self._lock:
            return len(self._active) if self._active else self._target

    def status(self) -> ElasticJobStatus:
        """A cheap snapshot: state, world size, step, epoch, batch, generation, workers, checkpoint (reads
        as a dict too: ``status()["step"]``)."""
        with self._lock:
            rec = self._last_rec or {}
            b = self._batch
            return ElasticJobStatus(
                state=self._state.value, world_size=len(self._active), target_world_size=self._target,
                slots=self.slots, generation=self._gen, step=self._last_step,
                epoch=rec.get("epoch", 0), loss=rec.get("loss"), samples_per_s=rec.get("samples_per_s"),
                global_batch=b.global_batch if b else None, accum_steps=b.accum_steps if b else None,
                per_worker_batch=b.per_worker_batch(max(1, len(self._active))) if b else None,
                gns=rec.get("gns"), predicted_goodput=self._predicted_goodput,
                workers={w.id: {"pid": w.pid, "state": w.state.value, "rank": w.rank}
                         for w in self._pool.values()},
                lost_steps=self._lost_steps, replays=self._replays, restarts=self._restarts,
                error=self._error, traceback=self._traceback,
                checkpoint_dir=str(self.checkpoint_dir.directory), record_samples=self.record_path)

    def metrics(self, since: int = 0) -> list[dict]:
        """Per-step records from index ``since`` on (keys: :data:`records.METRIC_KEYS`)."""
        return self._metrics.since(since)

    def events(self, since: int = 0) -> list[dict]:
        """Events (resizes, restarts, checkpoints, faults, ...) with their times, from index ``since``."""
        return self._events.since(since)

    def step_times(self, skip_first: int = 1, aggregate: bool = False) -> list[StepTime]:
        """Measured :class:`~.records.StepTime` rows (nodes, gpus, per_gpu_batch, accum_steps, iter_time)
        for a throughput-model fit (Pollux §4.1); the first ``skip_first`` steps of each generation
        (warm-up) and epoch-tail steps are left out. ``aggregate=True`` gives one row per configuration
        (median time)."""
        return step_time_rows(self._metrics.since(0), skip_first, aggregate)

    @property
    def fits_throughput(self) -> bool:
        """Whether the job fits its own throughput model (every ``goodput_refit_s``; 0 turns it off)."""
        return bool(self._refit_every_s)

    def throughput_model(self):
        """The throughput model (Pollux §4.1) the job last fitted to its step times, None before the first
        fit: published so that the live cluster's view of the job uses it instead of fitting again."""
        with self._lock:
            return self._throughput

    def worker_pids(self) -> dict[int, int]:
        """``{rank: pid}`` of the current generation (e.g. to inject a fault)."""
        with self._lock:
            return {w.rank: w.pid for w in self._active}

    def __enter__(self):
        return self.start() if self._state == JobState.NEW else self

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
        if global_batch is not None:
            whole("global_batch", global_batch, 1, "a positive integer")
        if accum_steps is not None:
            whole("accum_steps", accum_steps, 0, "a non-negative integer")
        if global_batch is None:
            with self._lock:
                global_batch = self._batch.global_batch if self._batch else self._base_batch()
        return BatchConfig(int(global_batch), int(accum_steps or 0))

    def _request(self, kind: Kind, _allow_stopped: bool = False, n: int | None = None,
                 batch: BatchConfig | None = None) -> Future:
        kind = Kind(kind)
        with self._lock:
            if self._state in TERMINAL and not _allow_stopped:
                raise RuntimeError(f"cannot {kind}: the job is {self._state}")
            if self._state == JobState.NEW and kind != Kind.STOP:
                if kind == Kind.RESIZE:
                    self._target = n
                    f = Future()
                    f.set_result({"world_size": n, "step": 0, "latency_s": 0.0})
                    return f
                raise RuntimeError(f"cannot {kind}: the job has not been started")
        fut: Future = Future()
        self._requests.put(Request(kind, fut, time.perf_counter(), n=n, batch=batch))
        with contextlib.suppress(Exception):
            self._wake_w.send(None)
        return fut
