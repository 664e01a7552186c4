"""The cluster's decisions driving a job launched under ``torchrun`` (c10d rendezvous), one agent per slot.

:class:`TorchrunJob` has the job-handle interface :class:`~elasticlab.cluster.LocalCluster` uses
(``status``, ``step_times``, ``metrics``, ``events``, ``resize``, ``pause``, ``resume``, ``stop``), so the
same scheduling loop drives it. Each slot is one elastic agent (``python -m torch.distributed.run
--nnodes=1:MAX --nproc-per-node=1 --rdzv_backend=c10d``), standing for one node; no cluster manager of our
own: membership is torchrun's rendezvous.

* grow: start more agents on the same rendezvous; torchrun restarts the workers at the new world size and
  they resume from the newest valid checkpoint (:func:`elasticlab.elastic.worker.torchrun_main`);
* shrink: end the newest agents with their workers (the rendezvous store is hosted by this object);
  the survivors' collectives fail, their agents re-rendezvous without them and resume likewise;
* pause: end every agent; resume: a fresh rendezvous at ``n`` agents.

Steps since the last checkpoint are replayed after a membership change; the sample record keeps the replay
(rows of the latest generation count, :func:`elasticlab.elastic.effective_rows`). The batch is the task's
(``torchrun_main`` has no way to set it on a running job), so torchrun jobs run in fixed-batch mode.
Run as ``python -m elasticlab.cluster.torchrun --entrypoint ... --checkpoint-dir ...`` it is the worker.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from elasticlab.elastic.records import EventLog, RecordLog, step_time_rows
from elasticlab.elastic.states import TERMINAL, TorchrunJobStatus, wait_terminal


class TorchrunJob:
    """A job run by torchrun agents on this machine (see the module docstring)."""

    supports_batch = False

    def __init__(self, entrypoint: str, *, workers: int, max_workers: int, checkpoint_dir: str,
                 entry_kwargs: dict | None = None, epochs: int = 1, max_steps: int | None = None,
                 checkpoint_every: int = 5, record_samples: str | None = None, lr_rule: str = "constant",
                 seed: int = 0, max_restarts: int = 50, name: str = "job"):
        if workers < 1 or max_workers < workers:
            raise ValueError(f"need 1 <= workers <= max_workers, got {workers}, {max_workers}")
        self.entrypoint, self.entry_kwargs = entrypoint, dict(entry_kwargs or {})
        self.max_workers, self.name = int(max_workers), name
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.record_path = str(record_samples) if record_samples else None
        self.opts = {"epochs": epochs, "max_steps": max_steps, "checkpoint_every": checkpoint_every,
                     "lr_rule": lr_rule, "seed": seed}
        self.max_restarts = int(max_restarts)
        self._target = int(workers)
        self._agents: list[subprocess.Popen] = []
        self._killed: set[int] = set()
        self._port = None
        self._store = None
        self._round = 0
        self._lock = threading.RLock()
        self._metrics, self._events = RecordLog(), EventLog()
        self._state = "new"
        self._last: dict = {}
        self._pending: tuple | None = None  # (future, n, from_size, t_request)
        self._done = 0
        self._done_t: float | None = None
        self._error: str | None = None
        self._watch: threading.Thread | None = None

    # ---- agents ---------------------------------------------------------------------------------
    def _command(self) -> list[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{self.max_workers}",
               "--nproc-per-node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{self._port}",
               f"--rdzv_id=elasticlab-{self.name}-{self._round}",
               "--rdzv_conf", "last_call_timeout=1,is_host=false",
               f"--max-restarts={self.max_restarts}", "--monitor-interval=0.2",
               "-m", "elasticlab.cluster.torchrun",
               "--entrypoint", self.entrypoint, "--entry-kwargs", json.dumps(self.entry_kwargs),
               "--checkpoint-dir", str(self.checkpoint_dir), "--options", json.dumps(self.opts)]
        if self.record_path:
            cmd += ["--record-samples", self.record_path]
        return cmd

    def _host_store(self) -> None:
        """The rendezvous store (torch's TCPStore on 127.0.0.1) lives here, not in an agent
        (``is_host=false``), so that the scheduler may end any agent without ending the rendezvous."""
        import datetime

        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=60))
        self._port = int(self._store.port)

    def _add_agent(self) -> None:
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen(self._command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, text=True, bufsize=1)
        self._agents.append(p)
        threading.Thread(target=self._read, args=(p,), daemon=True, name=f"torchrun-{p.pid}").start()
        self._events.emit("agent_start", pid=p.pid, agents=self._alive())

    def _kill_agent(self, p: subprocess.Popen) -> None:
        """SIGKILL an agent, then its workers (torchrun starts each worker in a session of its own): a
        graceful SIGTERM would close the whole rendezvous for the other agents too."""
        self._killed.add(p.pid)
        kids = []
        with contextlib.suppress(Exception):
            import psutil

            kids = psutil.Process(p.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        for k in kids:
            with contextlib.suppress(Exception):
                k.kill()
        self._events.emit("agent_stop", pid=p.pid, workers=[k.pid for k in kids])

    def _alive(self) -> int:
        return sum(1 for p in self._agents if p.poll() is None and p.pid not in self._killed)

    def _read(self, p: subprocess.Popen) -> None:
        tail: list[str] = []
        for line in p.stdout:
            line = line.strip()
            if not line.startswith("{"):
                tail = (tail + [line])[-20:]
                continue
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            ev = msg.pop("event", None)
            if ev == "step":
                self._on_step(msg)
            elif ev == "resume":
                self._events.emit("resume", **{k: v for k, v in msg.items() if k != "time"})
            elif ev == "done":
                with self._lock:
                    self._done += 1
                    self._done_t = self._done_t or time.monotonic()
        rc = p.wait()
        if rc != 0 and p.pid not in self._killed:
            with self._lock:
                self._error = f"agent {p.pid} exited with {rc}: " + " | ".join(tail[-5:])
            self._events.emit("error", generation=self._last.get("generation"), message=self._error)

    def _on_step(self, rec: dict) -> None:
        with self._lock:
            self._last = rec
            if self._state == "starting":
                self._state = "running"
            p = self._pending
        self._metrics.append(rec)
        if p is not None and rec["world_size"] == p[1]:
            with self._lock:
                self._pending = None
            lat = time.perf_counter() - p[3]
            self._events.emit("resize", from_size=p[2], to_size=p[1], step=rec["step"], latency_s=lat)
            p[0].set_result({"world_size": p[1], "step": rec["step"], "latency_s": lat})

    def _watcher(self) -> None:
        while True:
            time.sleep(0.1)
            with self._lock:
                if self._state in TERMINAL:
                    return
                paused = self._state == "paused"
            if paused or not self._agents:
                continue
            if self._done_t is not None and time.monotonic() - self._done_t > 5.0:
                # training is complete (a rank returned from torchrun_main); an agent that joined late
                # would otherwise wait out torchrun's exit barrier
                for p in self._agents:
                    if p.poll() is None and p.pid not in self._killed:
                        self._kill_agent(p)
            alive = [p for p in self._agents if p.pid not in self._killed]
            if all(p.poll() is not None for p in alive) and (alive or self._done):
                ok = all(p.returncode == 0 for p in alive) and self._done > 0
                with self._lock:
                    self._state = "finished" if ok else "failed"
                    pend, self._pending = self._pending, None
                if pend is not None:
                    pend[0].set_exception(RuntimeError(f"the job is {self._state}"))
                self._events.emit("finished" if ok else "failed", step=self._last.get("step"))
                return

    # ---- the job-handle interface ----------------------------------------------------------------
    def start(self) -> TorchrunJob:
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"job already started (state {self._state!r})")
            self._state = "starting"
        self._host_store()
        for _ in range(self._target):
            self._add_agent()
        self._watch = threading.Thread(target=self._watcher, daemon=True, name=f"torchrun-watch-{self.name}")
        self._watch.start()
        return self

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def _future(self, n: int, from_size: int) -> Future:
        fut: Future = Future()
        with self._lock:
            self._pending = (fut, n, from_size, time.perf_counter())
        return fut

    def resize(self, n: int, *, global_batch=None, accum_steps=None) -> Future:
        """Start or end agents so that ``n`` remain (the batch arguments are ignored: fixed batch)."""
        if not 1 <= n <= self.max_workers:
            raise ValueError(f"world size must be in [1, {self.max_workers}], got {n!r}")
        if self.state not in ("running", "starting") or self._done:
            raise RuntimeError(f"cannot resize: the job is {self.state}" + (" (training complete)"
                                                                            if self._done else ""))
        cur = self._alive()
        fut = self._future(n, int(self._last.get("world_size") or cur))
        if n > cur:
            for _ in range(n - cur):
                self._add_agent()
        elif n < cur:
            alive = [p for p in self._agents if p.poll() is None and p.pid not in self._killed]
            for p in alive[n:]:  # the newest ones
                self._kill_agent(p)
        else:
            fut.set_result({"world_size": n, "step": self._last.get("step", 0), "latency_s": 0.0})
            with self._lock:
                self._pending = None
        self._target = n
        return fut

    def set_batch(self, *a, **k) -> Future:
        raise RuntimeError("a torchrun job runs at its task's batch (torchrun_main cannot change it)")

    def pause(self) -> Future:
        """End every agent (the newest checkpoint keeps the progress)."""
        for p in self._agents:
            if p.poll() is None:
                self._kill_agent(p)
        with self._lock:
            self._state = "paused"
        self._events.emit("pause", step=self._last.get("step"))
        fut: Future = Future()
        fut.set_result(self._last.get("step", 0))
        return fut

    def resume(self, n: int | None = None) -> Future:
        """A fresh rendezvous with ``n`` agents, resuming from the newest checkpoint."""
        if self.state != "paused":
            raise RuntimeError(f"cannot resume: the job is {self.state}, not paused")
        n = int(n or self._target)
        self._round += 1
        self._host_store()
        with self._lock:
            self._state = "running"
        fut = self._future(n, 0)
        for _ in range(n):
            self._add_agent()
        self._target = n
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._state not in ("finished", "failed"):
                self._state = "stopped"
        for p in self._agents:
            if p.poll() is None:
                self._kill_agent(p)
        for p in self._agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        return wait_terminal(lambda: self.state, timeout)

    def status(self) -> TorchrunJobStatus:
        with self._lock:
            r = self._last
            running = self._state == "running"
            return TorchrunJobStatus(
                state=self._state, world_size=int(r.get("world_size") or 0) if running else 0,
                target_world_size=self._target, agents=self._alive(), step=r.get("step", 0),
                epoch=r.get("epoch", 0), loss=r.get("loss"), samples_per_s=r.get("samples_per_s"),
                global_batch=r.get("global_batch"), accum_steps=r.get("accum_steps"),
                per_worker_batch=r.get("per_worker_batch"), gns=r.get("gns"),
                generation=r.get("generation"), error=self._error)

    def metrics(self, since: int = 0) -> list[dict]:
        return self._metrics.since(since)

    def events(self, since: int = 0) -> list[dict]:
        return self._events.since(since)

    def step_times(self, skip_first: int = 1, aggregate: bool = False) -> list[tuple]:
        """``(nodes, gpus, per_gpu_batch, accum_steps, iter_time)`` rows, as ElasticJob's (one agent = one
        slot on this machine, so nodes = 1 in the throughput model)."""
        return step_time_rows(self._metrics.since(0), skip_first, aggregate)


def start_torchrun_job(spec, n: int, batch, slots: int, workdir: Path) -> TorchrunJob:
    """LocalCluster launcher for ``JobSpec(backend="torchrun")``."""
    ckpt = workdir / spec.name
    ckpt.mkdir(parents=True, exist_ok=True)
    record = spec.record_samples
    if record is True:
        record = str(ckpt / "samples.jsonl")
    job = TorchrunJob(spec.entrypoint, workers=n, max_workers=spec.max_slots, checkpoint_dir=str(ckpt),
                      entry_kwargs=spec.entry_kwargs, epochs=spec.epochs, max_steps=spec.max_steps,
                      checkpoint_every=max(1, min(spec.checkpoint_every, 10)), record_samples=record or None,
                      lr_rule=spec.lr_rule, seed=spec.seed, name=spec.name)
    return job.start()


def main(argv=None) -> int:
    """One torchrun worker: :func:`elasticlab.elastic.worker.torchrun_main` with JSON step lines."""
    from elasticlab.elastic.worker import torchrun_main

    ap = argparse.ArgumentParser(description="one torchrun worker of a LocalCluster job")
    ap.add_argument("--entrypoint", required=True)
    ap.add_argument("--entry-kwargs", default="{}")
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--record-samples", default=None)
    ap.add_argument("--options", default="{}")
    a = ap.parse_args(argv)
    opts = json.loads(a.options)
    out = torchrun_main(a.entrypoint, checkpoint_dir=a.checkpoint_dir, record_samples=a.record_samples,
                        entry_kwargs=json.loads(a.entry_kwargs), log_steps=True, **opts)
    # torchrun_main also returns when its agent ends it for a membership change (it checkpoints and
    # leaves): the job is done only if the newest checkpoint has all its work
    from elasticlab.elastic.checkpoint import CheckpointDir
    from elasticlab.elastic.checkpoint import load as load_checkpoint

    path, _ = CheckpointDir(a.checkpoint_dir).latest()
    state = load_checkpoint(path) if path is not None else {"step": 0, "sampler": {"epoch": 0}}
    max_steps = opts.get("max_steps")
    complete = (max_steps is not None and int(state["step"]) >= max_steps) or \
        int(state["sampler"]["epoch"]) >= int(opts.get("epochs", 1))
    print(json.dumps({"event": "done" if complete else "left", **out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
