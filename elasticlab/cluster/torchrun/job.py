"""A job run by torchrun agents, one per slot: :class:`TorchrunJob` and the agents' command line."""
from __future__ import annotations

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
from elasticlab.elastic.rendezvous import (
    TOKEN_ENV,
    bind_store,
    check_token,
    rdzv_id,
    split_endpoint,
)
from elasticlab.elastic.states import TERMINAL, TorchrunJobStatus, wait_terminal


def agent_command(endpoint: str, local_addr: str, nnodes: str, target: list[str], *, name: str = "job",
                  token: str | None = None, max_restarts: int = 50, monitor_interval: float = 0.2,
                  last_call_timeout: float = 1) -> tuple[list[str], dict]:
    """One torchrun agent (``--nproc-per-node=1``) joining the store at ``endpoint`` (hosted elsewhere:
    ``is_host=false``), advertising ``local_addr``; returns ``(argv, extra environment)``. The run id
    (derived from the token) and the token go by environment (``PET_RDZV_ID``), not by argv."""
    host, _ = split_endpoint(endpoint)
    check_token(host, token, "rendezvous endpoint")
    check_token(local_addr, token, "local address")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--local-addr={local_addr}",
           "--rdzv-conf", f"last_call_timeout={last_call_timeout},is_host=false",
           f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval}", *target]
    # the shared agent store (torch's default) would listen on every interface: workers host their own
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_RDZV_ID": rdzv_id(name, token),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if token:
        env[TOKEN_ENV] = token
    return cmd, env


class TorchrunJob:
    """A job run by torchrun agents on this machine, or on the ``nodes`` given (see the module docstring)."""

    supports_batch = False

    def __init__(self, entrypoint: str, *, workers: int, max_workers: int, checkpoint_dir: str,
                 entry_kwargs: dict | None = None, epochs: int = 1, max_steps: int | None = None,
                 checkpoint_every: int = 5, record_samples: str | None = None, lr_rule: str = "constant",
                 seed: int = 0, max_restarts: int = 50, name: str = "job", host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None, nodes: list[dict] | None = None,
                 step_delay_s: float = 0.0, log_dir: str | None = None, inject_faults=None):
        """``host``/``port``: where the rendezvous store listens (port 0: a free one). ``token``: the shared
        secret, by default ``$ELASTICLAB_TORCHRUN_TOKEN``; required when an address is not loopback.
        ``nodes``: where agents run, ``{"addr": local address, "prefix": argv prefix (e.g. ``ip netns exec
        NS``), "env": extra environment}`` each; a new agent goes to the node with the fewest live ones
        (default: one node, this machine, at ``host``). ``log_dir``: keep each agent's output there
        (``agent-<pid>.log``, lines prefixed by seconds since the job started). ``inject_faults``: fault
        points as :class:`~elasticlab.elastic.ElasticJob`'s, their generation torchrun's restart count."""
        if workers < 1 or max_workers < workers:
            raise ValueError(f"need 1 <= workers <= max_workers, got {workers}, {max_workers}")
        self.token = check_token(host, token if token is not None else os.environ.get(TOKEN_ENV) or None,
                                 "rendezvous host")
        self.host, self._want_port = host, int(port)
        self.nodes = [dict(n) for n in (nodes or [{"addr": host}])]
        for nd in self.nodes:
            if "addr" not in nd:
                raise ValueError(f"each node needs an 'addr' (its local address), got {nd!r}")
            check_token(nd["addr"], self.token, "node address")
        self._node_of: dict[int, int] = {}
        self.log_dir = Path(log_dir) if log_dir else None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        self.entrypoint, self.entry_kwargs = entrypoint, dict(entry_kwargs or {})
        self.max_workers, self.name = int(max_workers), name
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.record_path = str(record_samples) if record_samples else None
        self.opts = {"epochs": epochs, "max_steps": max_steps, "checkpoint_every": checkpoint_every,
                     "lr_rule": lr_rule, "seed": seed, "step_delay_s": float(step_delay_s)}
        if inject_faults:
            self.opts["inject_faults"] = [list(f) for f in inject_faults]
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
    def _command(self, node: dict) -> tuple[list[str], dict]:
        target = ["-m", "elasticlab.cluster.torchrun",
                  "--entrypoint", self.entrypoint, "--entry-kwargs", json.dumps(self.entry_kwargs),
                  "--checkpoint-dir", str(self.checkpoint_dir), "--options", json.dumps(self.opts)]
        if self.record_path:
            target += ["--record-samples", self.record_path]
        host = f"[{self.host}]" if ":" in self.host else self.host
        cmd, env = agent_command(f"{host}:{self._port}", node["addr"], f"1:{self.max_workers}", target,
                                 name=f"{self.name}-{self._round}", token=self.token,
                                 max_restarts=self.max_restarts)
        return list(node.get("prefix", [])) + cmd, {**env, **node.get("env", {})}

    @property
    def endpoint(self) -> tuple[str, int | None]:
        """``(host, port)`` of the rendezvous store (port None before :meth:`start`)."""
        return self.host, self._port

    def _host_store(self) -> None:
        """The rendezvous store (torch's TCPStore, listening on ``host`` only) lives here, not in an agent
        (``is_host=false``), so that the scheduler may end any agent without ending the rendezvous."""
        self._store = None  # a fixed port is free again before it is bound anew (resume)
        self._store = bind_store(self.host, self._want_port, timeout_s=60.0)
        self._port = int(self._store.port)

    def _add_agent(self) -> None:
        live = [self._node_of.get(p.pid) for p in self._agents
                if p.poll() is None and p.pid not in self._killed]
        idx = min(range(len(self.nodes)), key=lambda i: (live.count(i), i))
        cmd, env = self._command(self.nodes[idx])
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **env},
                             start_new_session=True, text=True, bufsize=1)
        self._agents.append(p)
        self._node_of[p.pid] = idx
        threading.Thread(target=self._read, args=(p,), daemon=True, name=f"torchrun-{p.pid}").start()
        self._events.emit("agent_start", pid=p.pid, agents=self._alive(), node=idx,
                          addr=self.nodes[idx]["addr"])

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
        log = open(self.log_dir / f"agent-{p.pid}.log", "w") if self.log_dir else None  # noqa: SIM115
        for line in p.stdout:
            line = line.strip()
            if log:
                log.write(f"{time.monotonic() - self._t0:8.2f} {line}\n")
                log.flush()
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
            elif ev in ("resume", "leave", "record_gap"):  # a restart's end (group formed) and start
                self._events.emit(ev, **{k: v for k, v in msg.items() if k != "time"})
            elif ev == "done":
                with self._lock:
                    self._done += 1
                    self._done_t = self._done_t or time.monotonic()
        rc = p.wait()
        if log:
            log.close()
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
            if p[2] == 0:  # a resume from pause: the elastic job's event kind "resumed"
                self._events.emit("resumed", world_size=p[1], step=rec["step"], latency_s=lat)
            else:
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
        self._store = None  # stop listening

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
