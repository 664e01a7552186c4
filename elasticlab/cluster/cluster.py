"""LocalCluster: a pool of worker slots shared by several live elastic jobs, and the scheduling loop.

Every ``interval`` seconds (and at every arrival and completion) the loop reads each job's fitted
throughput model and gradient noise scale (:class:`~elasticlab.cluster.view.LiveJob`), lets the chosen
allocation policy build its utility table and run the DP (:func:`elasticlab.alloc.dp_allocate`), and
applies the result: jobs are started, resized, paused or resumed and given the batch their policy's mode
picks (their own LR rule follows the batch inside the job). The restart penalty uses the measured cost of
the resizes done so far (:class:`~elasticlab.cluster.restart.RestartCost`).

Applying is a reconciliation run every tick: one request in flight per job, shrinks before grows, and a
grow only when the pool has the free slots, so the pool is never oversubscribed. A job that fails (its
task cannot be built, or it raises and makes no progress for ``crash_grace_s``) is stopped and its slots
return to the pool; the others keep running. Admission is ``"queue"`` (wait for slots) or ``"drop"``
(Saxena et al.: a job that cannot get its minimum now is dropped).
"""
from __future__ import annotations

import contextlib
import math
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from elasticlab.alloc.policies.base import Cluster as _Shape
from elasticlab.cluster.policies import make_policy
from elasticlab.cluster.restart import RestartCost
from elasticlab.cluster.spec import JobSpec
from elasticlab.cluster.view import TERMINAL, LiveJob
from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.records import EventLog

ADMISSION = ("queue", "drop")


def _start_elastic_job(spec: JobSpec, n: int, batch: BatchConfig, slots: int, workdir: Path):
    """The default job launcher: an :class:`~elasticlab.elastic.ElasticJob` on this machine, or torchrun
    agents for ``backend="torchrun"``."""
    from elasticlab.elastic import ElasticJob, FixedGlobalBatch

    if spec.backend == "torchrun":
        from elasticlab.cluster.torchrun import start_torchrun_job

        return start_torchrun_job(spec, n, batch, slots, workdir)

    ckpt = workdir / spec.name
    ckpt.mkdir(parents=True, exist_ok=True)
    record = spec.record_samples
    if record is True:
        record = str(ckpt / "samples.jsonl")
    job = ElasticJob(spec.entrypoint, workers=n, entry_kwargs=spec.entry_kwargs,
                     policy=FixedGlobalBatch(batch.global_batch, spec.per_slot_batch[1], spec.lr_rule),
                     epochs=spec.epochs, max_steps=spec.max_steps, slots=slots, warm=max(spec.warm, n),
                     checkpoint_dir=str(ckpt), checkpoint_every=spec.checkpoint_every, record_samples=record,
                     seed=spec.seed, timeout_s=spec.timeout_s, lr_rule=spec.lr_rule)
    return job.start()


class LocalCluster:
    """A pool of ``slots`` worker slots scheduled by ``policy`` (see :mod:`elasticlab.cluster.policies`).

    ``interval``: seconds between scheduling rounds; ``admission``: ``"queue"`` or ``"drop"``;
    ``restart_prior_s``: the restart delay assumed until one is measured; ``policy_kwargs``: passed to the
    policy; ``workdir``: checkpoints and sample records (default: a temporary directory).
    """

    def __init__(self, slots: int = 4, policy: str = "goodput", interval: float = 2.0, *,
                 admission: str = "queue", restart_prior_s: float = 2.0, policy_kwargs: dict | None = None,
                 workdir: str | None = None, hysteresis: float = 1.05, crash_grace_s: float = 8.0,
                 tick_s: float = 0.1, launcher=None):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if not (isinstance(interval, (int, float)) and interval > 0):
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        if admission not in ADMISSION:
            raise ValueError(f"admission must be one of {ADMISSION}, got {admission!r}")
        if not hysteresis >= 1.0:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis!r}")
        # torch is imported here, in the caller's thread: the loop and the sample counters use it from
        # their own threads, and two threads importing torch for the first time at once abort the process
        import torch.distributed  # noqa: F401
        self.slots = slots
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
        self._launch = launcher or _start_elastic_job
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
        if not isinstance(spec, JobSpec):
            if spec is not None:
                fields.setdefault("entrypoint", spec)
            if "entrypoint" not in fields:
                raise ValueError("submit needs a JobSpec or an entrypoint")
            spec = JobSpec(**fields)
        elif fields:
            raise ValueError("give a JobSpec or keyword fields, not both")
        from elasticlab.elastic.task import entrypoint_name

        spec.entrypoint = entrypoint_name(spec.entrypoint)
        with self._lock:
            if spec.name is None:
                base = spec.entrypoint.rsplit(":", 1)[-1]
                k = 1
                while f"{base}-{k}" in self._jobs:
                    k += 1
                spec.name = f"{base}-{k}"
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
                    job.state, job.finish_time = "dropped", self.now()
                    self._events.emit("drop", job=spec.name, reason=f"{need} of {self.slots} slots are "
                                      f"promised to running jobs; it needs {spec.min_slots}")
            self._dirty = True
        self._wake.set()
        return spec.name

    def start(self) -> LocalCluster:
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
                j.state = "stopped"
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

    def job(self, name: str):
        """The live job handle (an ElasticJob) of ``name``, None while it is queued."""
        return self._get(name).handle

    def jobs(self) -> list[dict]:
        """One row per job: state, slots, batch, step, epoch, GNS, predicted goodput, JCT so far, restarts."""
        now = self.now()
        with self._lock:
            jobs = list(self._jobs.values())
        rows = []
        for j in jobs:
            st = j.handle.status() if j.handle is not None else {}
            rows.append({"name": j.name, "state": j.state, "slots": j.held if j.state not in TERMINAL else 0,
                         "world_size": j.world_size, "target": j.target[0],
                         "global_batch": st.get("global_batch"), "accum_steps": st.get("accum_steps"),
                         "step": st.get("step", 0), "epoch": st.get("epoch", 0), "gns": st.get("gns"),
                         "goodput": j.predicted_goodput() if j.state == "running" else None,
                         "jct": j.jct(now), "restarts": j.restarts, "service": j.attained_service,
                         "error": j.error})
        return rows

    def metrics(self) -> dict:
        """Cluster metrics now: slots used, queue length, running/finished/failed/dropped, average JCT."""
        with self._lock:
            jobs = list(self._jobs.values())
        done = [j.finish_time - j.submission_time for j in jobs if j.state == "finished"]
        return {"t": self.now(), "slots": self.slots, "slots_used": sum(j.held for j in jobs
                                                                         if j.state not in TERMINAL),
                "queued": sum(j.state == "queued" for j in jobs),
                "running": sum(j.state in ("starting", "running") for j in jobs),
                "paused": sum(j.state == "paused" for j in jobs),
                "finished": len(done), "failed": sum(j.state == "failed" for j in jobs),
                "dropped": sum(j.state == "dropped" for j in jobs),
                "avg_jct": sum(done) / len(done) if done else None,
                "restart_cost_s": self.restart_cost.estimate, "policy": self.policy_name}

    def history(self) -> list[dict]:
        """``[{"t", "slots": {job: world size}, "batch": {job: global batch}}]``, one row per change."""
        with self._lock:
            return [dict(r) for r in self._history]

    def rounds(self) -> list[dict]:
        """Every scheduling decision: time, allocation, batches, the restart delay used, DP seconds."""
        with self._lock:
            return [dict(r) for r in self._rounds]

    def events(self, since: int = 0) -> list[dict]:
        """Cluster events (submit, refused, drop, start, resize, set_batch, pause, resume, finished,
        failed, stop, round) from index ``since``."""
        return self._events.since(since)

    def summary(self) -> dict:
        """JCT per job, average JCT of the finished jobs, makespan, resizes and the measured restart cost."""
        with self._lock:
            jobs = list(self._jobs.values())
        jct = {j.name: (j.finish_time - j.submission_time) for j in jobs if j.state == "finished"}
        ends = [j.finish_time for j in jobs if j.finish_time is not None]
        return {"policy": self.policy_name, "slots": self.slots,
                "jct": jct, "avg_jct": sum(jct.values()) / len(jct) if jct else None,
                "states": {j.name: j.state for j in jobs},
                "makespan": (max(ends) - min(j.submission_time for j in jobs)) if ends and jobs else None,
                "restarts": {j.name: j.restarts for j in jobs},
                "restart_cost": self.restart_cost.as_dict(), "rounds": len(self._rounds),
                "errors": {j.name: j.error for j in jobs if j.error}}

    def sample_check(self, name: str) -> dict:
        """Exactly-once check of a job's sample record (:func:`elasticlab.elastic.check_exactly_once`)."""
        import json

        from elasticlab.elastic import check_exactly_once
        from elasticlab.elastic.task import build

        j = self._get(name)
        path = j.handle.record_path if j.handle is not None else None
        if not path:
            raise ValueError(f"job {name!r} has no sample record (submit it with record_samples=True)")
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        n = len(build(j.spec.entrypoint, j.spec.entry_kwargs))
        return check_exactly_once(rows, n)

    # ---- the loop ---------------------------------------------------------------------------------
    def _get(self, name: str) -> LiveJob:
        with self._lock:
            if name not in self._jobs:
                raise ValueError(f"no job named {name!r}; jobs: {sorted(self._jobs)}")
            return self._jobs[name]

    def _loop(self) -> None:
        last = self.now()
        while not self._stop.is_set():
            try:
                now = self.now()
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
            if hs == "finished":
                self._end(j, "finished", now)
            elif hs in ("failed", "stopped"):
                j.error = j.error or st.get("error")
                self._end(j, "failed", now)
            elif j.error_seen_t is not None and \
                    now - max(j.error_seen_t, j.last_step_t or 0) > self.crash_grace_s:
                self._end(j, "failed", now)
            elif hs == "paused" and j.state != "paused" and j.pending is None:
                j.state = "paused"
            elif hs == "running":
                j.state = "running"

    def _settle(self, j: LiveJob, now: float) -> None:
        """Resolve the request in flight: release the slots a finished shrink or pause gave back."""
        if j.pending is None:
            return
        kind, fut, info = j.pending
        if not fut.done():
            return
        j.pending = None
        if fut.exception() is not None:
            self._events.emit("request_failed", job=j.name, request=kind, error=repr(fut.exception()))
            return
        if kind == "pause":
            j.held, j.state = 0, "paused"
        elif kind in ("resize", "resume"):
            j.held = info["n"]
        self._events.emit(f"{kind}_done", job=j.name, **{k: v for k, v in info.items() if k != "batch"},
                          result=fut.result() if kind != "pause" else None)

    def _end(self, j: LiveJob, state: str, now: float) -> None:
        with self._lock:
            j.state, j.finish_time, j.held, j.target = state, now, 0, (0, None)
            self._dirty = True
        self._events.emit(state, job=j.name, jct=now - j.submission_time, error=j.error)
        if state == "failed":
            self._stop_handle(j)

    def _stop_handle(self, j: LiveJob) -> None:
        h = j.handle
        if h is None or getattr(j, "_stopping", False):
            return
        j._stopping = True
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
        alloc = pol.allocate(active, now, _Shape(1, self.slots))
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
            j.target = (n, batch)
            out[j.name] = {"slots": n, "global_batch": batch.global_batch if batch else None,
                           "accum_steps": batch.accum_steps if batch else None}
        rnd = {"t": now, "policy": self.policy_name, "alloc": out,
               "restart_delay_s": self.restart_cost.estimate, "dp_s": dp_s}
        with self._lock:
            self._rounds.append(rnd)

    def _apply(self, now: float) -> None:
        with self._lock:
            jobs = sorted((j for j in self._jobs.values() if j.state not in TERMINAL),
                          key=lambda j: (j.submission_time, j.name))
            free = self.slots - sum(j.held for j in jobs)
        # shrinks and pauses first, so that grows find their slots
        for j in jobs:
            n, batch = j.target
            if j.pending is not None or j.handle is None or j.state not in ("running",):
                continue
            ws = j.handle.status()["world_size"]
            if n == 0:
                self._request(j, "pause", j.handle.pause, n=0)
            elif n < ws:
                self._request(j, "resize", partial(j.handle.resize, n, global_batch=batch.global_batch,
                                                           accum_steps=batch.accum_steps),
                              n=n, batch=batch, from_size=ws)
        for j in jobs:
            n, batch = j.target
            if j.pending is not None or n == 0:
                continue
            if j.handle is None and j.state == "queued":
                if n <= free:
                    free -= n
                    j.held, j.state, j.start_time = n, "starting", now
                    try:
                        j.handle = self._launch(j.spec, n, batch, self.slots, self.workdir)
                    except Exception as e:
                        j.error = f"could not start: {e!r}"
                        self._end(j, "failed", now)
                        continue
                    self._events.emit("start", job=j.name, slots=n, global_batch=batch.global_batch,
                                      wait_s=now - j.submission_time)
                continue
            if j.handle is None:
                continue
            st = j.handle.status()
            if j.state == "paused" and st["state"] == "paused":
                if n - j.held <= free:
                    free -= n - j.held
                    j.held = n
                    self._request(j, "resume", partial(j.handle.resume, n), n=n)
                continue
            if j.state != "running" or st["state"] != "running":
                continue
            ws = st["world_size"]
            if n > ws:
                if n - j.held <= free:
                    free -= n - j.held
                    j.held = n
                    self._request(j, "resize", partial(j.handle.resize, n, global_batch=batch.global_batch,
                                                               accum_steps=batch.accum_steps),
                                  n=n, batch=batch, from_size=ws)
            elif n == ws and batch is not None and st.get("global_batch") and \
                    getattr(j.handle, "supports_batch", True) and (
                    batch.global_batch != st["global_batch"] or batch.accum_steps != st["accum_steps"]):
                self._request(j, "set_batch", partial(j.handle.set_batch, batch.global_batch,
                                                              accum_steps=batch.accum_steps),
                              n=n, batch=batch)

    def _request(self, j: LiveJob, kind: str, call, **info) -> None:
        try:
            fut = call()
        except RuntimeError as e:  # the job ended between the status read and the request
            self._events.emit("request_failed", job=j.name, request=kind, error=str(e))
            return
        j.pending = (kind, fut, info)
        if kind in ("resize", "pause", "resume"):
            j.num_restarts += 1
        extra = {k: v for k, v in info.items() if k != "batch"}
        if info.get("batch") is not None:
            extra.update(global_batch=info["batch"].global_batch, accum_steps=info["batch"].accum_steps)
        self._events.emit(kind, job=j.name, **extra)

    def _record_history(self, now: float) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        slots, batch = {}, {}
        for j in jobs:
            ws = j.world_size
            slots[j.name] = ws
            if j.handle is not None and ws:
                batch[j.name] = j.handle.status().get("global_batch")
        with self._lock:
            last = self._history[-1] if self._history else None
            if last is None or last["slots"] != slots or last["batch"] != batch:
                self._history.append({"t": now, "slots": slots, "batch": batch})
