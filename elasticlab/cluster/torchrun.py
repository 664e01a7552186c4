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

Addresses. Nothing here listens on every interface (torch's ``TCPStore`` does, whatever host it is given,
so the sockets are bound here and handed to it, :func:`bind_store`): the rendezvous store listens on
``host`` (127.0.0.1 by default, or the cluster address for agents on other hosts), each agent advertises its
``--local-addr``, the rank-0 worker's store listens on that address (:func:`worker_store`) and gloo on the
interface that holds it. A non-loopback address needs the shared token (``ELASTICLAB_TORCHRUN_TOKEN``,
:func:`check_token`): it names every rendezvous and worker-store key (:func:`rdzv_id`), and travels by
environment, never on a command line. ``python -m elasticlab.cluster.torchrun store --bind HOST:PORT`` and
``... agent --endpoint HOST:PORT --local-addr ADDR --nnodes MIN:MAX -- SCRIPT ARGS`` run the same pieces
by hand, one per host.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from elasticlab.elastic.records import EventLog, RecordLog, step_time_rows
from elasticlab.elastic.states import TERMINAL, TorchrunJobStatus, wait_terminal

# ---- addresses, the token, stores bound to one address -------------------------------------------
TOKEN_ENV = "ELASTICLAB_TORCHRUN_TOKEN"
MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve address {host!r}: {exc}") from None
    return all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_token(host: str, token: str | None, what: str = "address") -> str | None:
    """The token a non-loopback ``host`` needs (torch's TCPStore has no authentication of its own): an
    error names the address and the environment variable when it is missing or shorter than 16 chars."""
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{TOKEN_ENV} must be at least {MIN_TOKEN_CHARS} characters, got {len(token)}")
    if not token and not is_loopback(host):
        raise ValueError(f"{what} {host!r} is reachable from other hosts: set {TOKEN_ENV} to a shared secret "
                         f"of at least {MIN_TOKEN_CHARS} characters (e.g. `python -c 'import secrets; "
                         f"print(secrets.token_hex(16))'`), the same on every host, or use 127.0.0.1")
    return token or None


def token_digest(token: str | None) -> str:
    """The secret part of every store key name derived from the token ('' without one)."""
    return hashlib.sha256(b"elasticlab-torchrun\0" + token.encode()).hexdigest()[:32] if token else ""


def rdzv_id(name: str, token: str | None) -> str:
    """The c10d run id: every rendezvous key (``torch.rendezvous.<run id>...``) contains it, so with a
    token nobody without it can read or write this job's rendezvous state (TCPStore cannot list keys)."""
    d = token_digest(token)
    return f"elasticlab-{name}" + (f"-{d}" if d else "")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"endpoint must be HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), int(port)


def bind_store(host: str, port: int = 0, *, timeout_s: float = 60.0):
    """A torch ``TCPStore`` server listening on ``host`` only. TCPStore itself binds every interface
    whatever host it is given, so the socket is bound here and handed over (``master_listen_fd``)."""
    import datetime

    import torch.distributed as dist

    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
    s = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(info[4])
        s.listen(1024)
    except OSError as exc:
        s.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    port = s.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=s.detach(),
                         use_libuv=True, timeout=datetime.timedelta(seconds=timeout_s))


def interface_of(addr: str) -> str | None:
    """The name of the network interface that holds the local IPv4 address ``addr`` (None if none)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                if socket.inet_ntoa(raw[20:24]) == addr:
                    return name
    return None


def source_address(peer: str) -> str:
    """The local address this host uses to reach ``peer`` (no packet is sent)."""
    info = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as s:
        s.connect(info[4])
        return s.getsockname()[0]


def worker_store(timeout_s: float = 30.0):
    """The store a torchrun worker forms its process group with, bound to ``MASTER_ADDR`` only.

    torchrun (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) gives rank 0's node address and a free port as
    ``MASTER_ADDR``/``MASTER_PORT``; rank 0 listens there (not on every interface as ``env://`` would),
    the others connect. Keys are prefixed by the token's digest. Gloo is pointed at
    the interface this host reaches ``MASTER_ADDR`` through (``GLOO_SOCKET_IFNAME``, unless set), so its
    listening sockets bind that interface's address (127.0.0.1 on one machine)."""
    import datetime

    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank = int(os.environ["RANK"])
    token = check_token(addr, os.environ.get(TOKEN_ENV) or None, "MASTER_ADDR")
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        ifname = interface_of(source_address(addr))
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    if rank == 0:
        store = bind_store(addr, port, timeout_s=timeout_s)
    else:
        store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    # no restart count in the prefix: it is per agent (a joining agent starts at 0), and every rendezvous
    # round gives a new MASTER_PORT, hence a fresh store, anyway
    return dist.PrefixStore(f"elasticlab/{token_digest(token)}", store)


def listening_sockets(pids) -> list[dict]:
    """TCP sockets in LISTEN state owned by ``pids``: ``{"pid", "addr", "port"}`` each, read from
    ``/proc/<pid>/net/tcp{,6}`` (the process's own network namespace) and ``/proc/<pid>/fd``."""
    out = []
    for pid in pids:
        try:
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
            for table, width in (("tcp", 4), ("tcp6", 16)):
                with open(f"/proc/{pid}/net/{table}") as f:
                    next(f)
                    for line in f:
                        cols = line.split()
                        if cols[3] != "0A" or cols[9] not in inodes:  # 0A: TCP_LISTEN
                            continue
                        hexaddr, hexport = cols[1].split(":")
                        raw = bytes.fromhex(hexaddr)
                        # /proc prints the address as 32-bit words in host (little-endian) order
                        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                        ip = ipaddress.ip_address(raw)
                        if ip.version == 6 and ip.ipv4_mapped:
                            ip = ip.ipv4_mapped
                        out.append({"pid": pid, "addr": str(ip), "port": int(hexport, 16)})
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # the process ended meanwhile
    return out


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
                 step_delay_s: float = 0.0, log_dir: str | None = None):
        """``host``/``port``: where the rendezvous store listens (port 0: a free one). ``token``: the shared
        secret, by default ``$ELASTICLAB_TORCHRUN_TOKEN``; required when an address is not loopback.
        ``nodes``: where agents run, ``{"addr": local address, "prefix": argv prefix (e.g. ``ip netns exec
        NS``), "env": extra environment}`` each; a new agent goes to the node with the fewest live ones
        (default: one node, this machine, at ``host``). ``log_dir``: keep each agent's output there
        (``agent-<pid>.log``, lines prefixed by seconds since the job started)."""
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
            elif ev in ("resume", "leave"):  # a restart's start (workers drained) and end (group formed)
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


def store_main(argv) -> int:
    """``store --bind HOST:PORT``: host a rendezvous store on that address only, until SIGTERM/SIGINT.
    Prints ``{"event": "store", "host", "port", "pid"}``. A non-loopback HOST needs the token
    (``$ELASTICLAB_TORCHRUN_TOKEN``)."""
    ap = argparse.ArgumentParser(prog="python -m elasticlab.cluster.torchrun store",
                                 description="host the c10d rendezvous store of torchrun agents")
    ap.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT to listen on (default 127.0.0.1:0)")
    a = ap.parse_args(argv)
    host, port = split_endpoint(a.bind)
    try:
        check_token(host, os.environ.get(TOKEN_ENV) or None, "--bind address")
    except ValueError as exc:
        ap.error(str(exc))
    store = bind_store(host, port)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(json.dumps({"event": "store", "host": host, "port": int(store.port), "pid": os.getpid()}),
          flush=True)
    done.wait()
    return 0


def agent_main(argv) -> int:
    """``agent --endpoint HOST:PORT [--local-addr ADDR] [--nnodes MIN:MAX] [--name N] -- SCRIPT ARGS``:
    exec one torchrun agent the way :class:`TorchrunJob` starts them (see :func:`agent_command`)."""
    ap = argparse.ArgumentParser(prog="python -m elasticlab.cluster.torchrun agent",
                                 description="one torchrun agent joining a store hosted with `store`")
    ap.add_argument("--endpoint", required=True, help="HOST:PORT of the rendezvous store")
    ap.add_argument("--local-addr", default="127.0.0.1",
                    help="this host's cluster address (default 127.0.0.1)")
    ap.add_argument("--nnodes", default="1:2")
    ap.add_argument("--name", default="job", help="the job's name (same on every host)")
    ap.add_argument("--max-restarts", type=int, default=50)
    ap.add_argument("target", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS (or -- -m MODULE ARGS)")
    a = ap.parse_args(argv)
    target = a.target[1:] if a.target[:1] == ["--"] else a.target
    if not target:
        ap.error("give the training script after --")
    try:
        cmd, env = agent_command(a.endpoint, a.local_addr, a.nnodes, target, name=a.name,
                                 token=os.environ.get(TOKEN_ENV) or None, max_restarts=a.max_restarts)
    except ValueError as exc:
        ap.error(str(exc))
    os.execve(cmd[0], cmd, {**os.environ, **env})
    return 1  # not reached


def main(argv=None) -> int:
    """One torchrun worker: :func:`elasticlab.elastic.worker.torchrun_main` with JSON step lines (or the
    ``store`` / ``agent`` commands, see :func:`store_main`, :func:`agent_main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["store"]:
        return store_main(argv[1:])
    if argv[:1] == ["agent"]:
        return agent_main(argv[1:])
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


def exit_now(code: int = 0) -> None:
    """End a torchrun worker without the interpreter's teardown: torchrun waits for the worker's exit
    before it re-rendezvous, and the teardown (scikit-learn's and OpenMP's exit handlers among others)
    took 2-10 s of every membership change on 2 loaded cores. Everything the worker keeps is written
    by then (checkpoints are fsynced, the sample record closed, the group destroyed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
