"""The scheduling loop every cluster backend shares: rounds, policies, requests and the event log.

Every ``interval`` seconds (and at every arrival and completion) each job is read as a
:class:`~elasticlab.cluster.view.LiveJob` (fitted throughput model, live GNS), the policy allocates slots
(:func:`elasticlab.alloc.dp_allocate`) with the measured restart cost
(:class:`~elasticlab.cluster.restart.RestartCost`), and the result is applied every tick as a
reconciliation (:mod:`~elasticlab.cluster.reconcile`): one request in flight per job, shrinks before
grows, a grow only into free slots. A job
that fails (or raises and makes no progress for ``crash_grace_s``) gives its slots back. Admission is
``"queue"`` or ``"drop"`` (Saxena et al.: a job that cannot get its minimum now is dropped).

A backend subclasses :class:`Scheduler` and sets ``slots`` (the capacity now) and gives
:meth:`~Scheduler._launch_job`; one with nodes also :meth:`~Scheduler.shape`, :meth:`~Scheduler._placed`
(a round's counts on nodes) and :meth:`~Scheduler._observe` (every tick, e.g. a node lost):
:class:`~elasticlab.cluster.LocalCluster` and :class:`~elasticlab.cluster.ray.RayCluster`.
"""
from __future__ import annotations

import contextlib
import math
import tempfile
import threading
import time
from pathlib import Path

from elasticlab.alloc.policies.base import Cluster as Shape
from elasticlab.checks import number, seconds
from elasticlab.cluster.policies import make_policy
from elasticlab.cluster.reconcile import Reconciler
from elasticlab.cluster.reports import ClusterReports
from elasticlab.cluster.restart import RestartCost
from elasticlab.cluster.spec import JobSpec
from elasticlab.cluster.view import TERMINAL, LiveJob, LiveState, Target
from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.records import EventLog
from elasticlab.elastic.states import JobState

ADMISSION = ("queue", "drop")


class Scheduler(Reconciler, ClusterReports):
    """The backend-independent scheduling loop (see the module docstring); ``slots`` is set by the backend.

    ``interval``: seconds between scheduling rounds; ``admission``: ``"queue"`` or ``"drop"``;
    ``restart_prior_s``: the restart delay assumed until one is measured; ``policy_kwargs``: passed to the
    policy; ``workdir``: checkpoints and sample records (default: a temporary directory).
    """

    slots: int = 0

    def __init__(self, policy: str = "goodput", interval: float = 2.0, *,
                 admission: str = "queue", restart_prior_s: float = 2.0, policy_kwargs: dict | None = None,
                 workdir: str | None = None, hysteresis: float = 1.05, crash_grace_s: float = 8.0,
                 tick_s: float = 0.1):
        interval = seconds("interval", interval)
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {ADMISSION}, got {admission!r}")
        number("hysteresis", hysteresis, lambda h: h >= 1.0, "a finite factor >= 1")
        seconds("crash_grace_s", crash_grace_s, zero_ok=True)
        seconds("tick_s", tick_s)
        # torch is imported here, in the caller's thread: the loop and the sample counters use it from
        # their own threads, and two threads importing torch for the first time at once abort the process
        import torch.distributed  # noqa: F401
        self.interval = float(interval)
        self.admission = admission
        self.hysteresis = float(hysteresis)
        self.crash_grace_s = float(crash_grace_s)
        self.tick_s = float(tick_s)
        self.restart_cost = RestartCost(restart_prior_s)
        self.set_policy(policy, **(policy_kwargs or {}))
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="elasticlab-cluster-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self._jobs: dict[str, LiveJob] = {}
        self._lock = threading.RLock()
        self._events = EventLog()
        self._history: list[dict] = []
        self._rounds: list[dict] = []
        self._t0 = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._last_round = -math.inf
        self._dirty = True
        self._stoppers: list[threading.Thread] = []


    # ---- what a backend gives ---------------------------------------------------------------------
    def shape(self) -> Shape:
        """The cluster as the policies see it (nodes x slots per node); default: one node of ``slots``."""
        return Shape(1, max(int(self.slots), 1))

    def _launch_job(self, j: LiveJob, n: int, batch: BatchConfig):
        """Start ``j`` on ``n`` slots at ``batch``; return its job handle (status, resize, pause, ...)."""
        raise NotImplementedError

    def _placed(self, counts: dict[str, int]) -> dict | None:
        """Place a round's slot counts on nodes (recorded in the round); default: nothing to place."""
        return None

    def _observe(self, now: float) -> None:
        """Called every tick before the jobs are polled (e.g. to notice a node that is gone)."""

    # ---- public API -----------------------------------------------------------------------------
    def set_policy(self, name: str, **kwargs) -> None:
        """Switch the scheduling policy (takes effect at the next round)."""
        pol = make_policy(name, **kwargs)
        with getattr(self, "_lock", contextlib.nullcontext()):
            self.policy_name, self.policy = name, pol
            self.batch_mode = pol.batch_mode
            for j in getattr(self, "_jobs", {}).values():
                j.batch_mode = self._mode_for(j.spec)
            self._dirty = True

    def _mode_for(self, spec) -> str:
        return "fixed" if spec.backend == "torchrun" else self.batch_mode

    def now(self) -> float:
        """Seconds since the cluster was created (the clock of events, JCTs and history)."""
        return time.monotonic() - self._t0

    def submit(self, spec: JobSpec | object = None, **fields) -> str:
        """Queue a job: a :class:`JobSpec`, or its fields as keywords. Returns the job's name.

        Raises ValueError (naming the value) for a bad spec, e.g. a minimum above the pool's slots."""
        spec = JobSpec.of(spec, **fields)
        with self._lock:
            if spec.name is None:
                spec.name = spec.free_name(self._jobs)
            if spec.name in self._jobs:
                raise ValueError(f"a job named {spec.name!r} was already submitted")
            try:
                spec.validate(self.slots)
            except ValueError as e:
                self._events.emit("refused", job=spec.name, reason=str(e))
                raise
            job = LiveJob(spec, self.now(), self._mode_for(spec))
            self._jobs[spec.name] = job
            job.count_samples()
            self._events.emit("submit", job=spec.name, entrypoint=spec.entrypoint, min_slots=spec.min_slots,
                              max_slots=spec.max_slots, initial_batch=spec.initial_batch,
                              max_batch=spec.max_batch)
            if self.admission == "drop":
                need = sum(j.spec.min_slots for j in self._jobs.values()
                           if j.state not in TERMINAL and j is not job)
                if need + spec.min_slots > self.slots:
                    job.state, job.finish_time = LiveState.DROPPED, self.now()
                    self._events.emit("drop", job=spec.name, reason=f"{need} of {self.slots} slots are "
                                      f"promised to running jobs; it needs {spec.min_slots}")
            self._dirty = True
        self._wake.set()
        return spec.name

    def start(self) -> Scheduler:
        """Start the scheduling loop in a background thread; returns at once."""
        if self._thread is not None:
            raise RuntimeError("the cluster is already started")
        self._thread = threading.Thread(target=self._loop, name="elasticlab-cluster", daemon=True)
        self._thread.start()
        self._events.emit("cluster_start", slots=self.slots, policy=self.policy_name, interval=self.interval)
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job is finished, failed, dropped or stopped; True unless timed out."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if all(j.state in TERMINAL for j in self._jobs.values()):
                    return True
            if end is not None and time.monotonic() > end:
                return False
            time.sleep(0.05)

    def run(self, timeout: float | None = None) -> dict:
        """Start (if needed), wait for every job, stop; return :meth:`summary`."""
        if self._thread is None:
            self.start()
        try:
            ok = self.wait(timeout)
        finally:
            self.stop()
        out = self.summary()
        out["timed_out"] = not ok
        return out

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop and every job still running (their worker processes end)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            jobs = list(self._jobs.values())
        for j in jobs:
            if j.state not in TERMINAL:
                j.state = LiveState.STOPPED
                j.finish_time = self.now()
                j.held = 0
                self._events.emit("stop", job=j.name)
            if j.handle is not None:
                self._stop_handle(j)
        for t in list(self._stoppers):
            t.join(timeout)

    def __enter__(self):
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.stop()


    # ---- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        last = self.now()
        while not self._stop.is_set():
            try:
                now = self.now()
                self._observe(now)
                self._poll(now, now - last)
                last = now
                if self._dirty or now - self._last_round >= self.interval:
                    self._decide(now)
                self._apply(now)
                self._record_history(now)
            except Exception as e:  # keep scheduling; a bug here must not orphan the jobs
                self._events.emit("error", message=repr(e))
            self._wake.wait(self.tick_s)
            self._wake.clear()

    def _poll(self, now: float, dt: float) -> None:
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.handle is not None and j.state not in TERMINAL]
        for j in jobs:
            h = j.handle
            st = h.status()
            hs = st["state"]
            j.attained_service += dt * st["world_size"]
            if st["step"] != j.last_step:
                j.last_step, j.last_step_t = st["step"], now
            for ev in h.events(j.event_index):
                j.event_index += 1
                if ev["kind"] == "resize" and ev.get("from_size"):
                    self.restart_cost.observe(ev.get("latency_s"))
                elif ev["kind"] == "error" and ev.get("generation") is not None and j.error_seen_t is None:
                    j.error_seen_t, j.error = now, ev.get("message")
                elif ev["kind"] in ("fault", "restart", "generation"):
                    j.error_seen_t = None
            j.refit()
            self._settle(j, now)
            if hs == JobState.FINISHED:
                self._end(j, LiveState.FINISHED, now)
            elif hs in (JobState.FAILED, JobState.STOPPED):
                j.error = j.error or st.get("error")
                self._end(j, LiveState.FAILED, now)
            elif j.error_seen_t is not None and \
                    now - max(j.error_seen_t, j.last_step_t or 0) > self.crash_grace_s:
                self._end(j, LiveState.FAILED, now)
            elif hs == JobState.PAUSED and j.state != LiveState.PAUSED and j.pending is None:
                j.state = LiveState.PAUSED
            elif hs == JobState.RUNNING:
                j.state = LiveState.RUNNING

    def _end(self, j: LiveJob, state: LiveState, now: float) -> None:
        with self._lock:
            j.state, j.finish_time, j.held, j.target = state, now, 0, Target(0, None)
            self._dirty = True
        self._events.emit(state.value, job=j.name, jct=now - j.submission_time, error=j.error)
        if state == LiveState.FAILED:
            self._stop_handle(j)

    def _stop_handle(self, j: LiveJob) -> None:
        h = j.handle
        if h is None or j.stopping:
            return
        j.stopping = True
        t = threading.Thread(target=lambda: h.stop(timeout=10), name=f"stop-{j.name}", daemon=True)
        t.start()
        self._stoppers.append(t)

    def _decide(self, now: float) -> None:
        with self._lock:
            active = [j for j in self._jobs.values() if j.state not in TERMINAL]
            self._dirty = False
        self._last_round = now
        if not active:
            return
        pol = self.policy
        if hasattr(pol, "restart_delay"):  # Pollux's delta, measured (restart.py)
            pol.restart_delay = self.restart_cost.estimate
        t0 = time.perf_counter()
        alloc = pol.allocate(active, now, self.shape())
        dp_s = time.perf_counter() - t0
        out = {}
        for j in active:
            n = int(alloc.get(j.name, 0))
            n = min(n, j.spec.max_slots)
            if n < j.spec.min_slots:
                n = 0
            cur = j.handle.status() if j.handle is not None else {}
            current = BatchConfig(cur["global_batch"], cur["accum_steps"]) \
                if cur.get("global_batch") else None
            batch = j.best_batch(n, j.batch_mode, current if n == cur.get("world_size") else None,
                                 self.hysteresis) if n > 0 else None
            j.target = Target(n, batch)
            out[j.name] = {"slots": n, "global_batch": batch.global_batch if batch else None,
                           "accum_steps": batch.accum_steps if batch else None}
        placement = self._placed({k: v["slots"] for k, v in out.items()})
        rnd = {"t": now, "policy": self.policy_name, "alloc": out,
               "restart_delay_s": self.restart_cost.estimate, "dp_s": dp_s}
        if placement:
            rnd["placement"] = placement
        with self._lock:
            self._rounds.append(rnd)
