"""Where a job's c10d stores listen, and who may use them: stores bound to one address, the shared token,
a socket scan.

torch's ``TCPStore`` listens on every interface whatever host it is given, so :func:`bind_store` binds the
socket to one address and hands it over (``master_listen_fd``); the elastic job's generations
(:mod:`.controller`), the torchrun path (:mod:`elasticlab.cluster.torchrun`, :func:`worker_store`) and the Ray
backend (:mod:`elasticlab.cluster.ray.store`) all make their stores here. A non-loopback address needs the
shared token (``ELASTICLAB_TORCHRUN_TOKEN``, :func:`check_token`): its digest names every rendezvous and
worker-store key (:func:`rdzv_id`, :func:`token_digest`); it travels by environment, never on a command line.
"""
from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import socket

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


def _listeners(pids):
    """``(pid, inode, address, port)`` of each TCP socket in LISTEN state owned by ``pids``, read from
    ``/proc/<pid>/net/tcp{,6}`` (the process's own network namespace) and ``/proc/<pid>/fd``."""
    for pid in pids:
        try:
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
            rows = []
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
                        rows.append((pid, cols[9], str(ip), int(hexport, 16)))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # the process ended meanwhile
        yield from rows


def listening_sockets(pids, *, exclude=()) -> list[dict]:
    """TCP sockets in LISTEN state owned by ``pids``: ``{"pid", "addr", "port"}`` each, read from
    ``/proc/<pid>/net/tcp{,6}`` (the process's own network namespace) and ``/proc/<pid>/fd``; ``exclude``:
    socket inodes to leave out (:func:`listener_inodes` taken before)."""
    exclude = set(exclude)
    return [{"pid": pid, "addr": addr, "port": port} for pid, inode, addr, port in _listeners(pids)
            if inode not in exclude]


def listener_inodes(pids) -> set[str]:
    """The inodes of the listening sockets ``pids`` own now (a baseline for ``listening_sockets``)."""
    return {inode for _, inode, _, _ in _listeners(pids)}


def _ray_dirs() -> tuple[str, ...]:
    import importlib.util

    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("ray")  # where it is installed; not imported
        if spec is not None and spec.submodule_search_locations:
            return tuple(os.path.join(d, "") for d in spec.submodule_search_locations)
    return ()


def is_ray_process(pid: int) -> bool:
    """Whether ``pid`` is one of Ray's own processes: a worker (its title ``ray::...``) or a program of the
    ``ray`` package (GCS, raylet, agents, dashboard, monitors), read from ``/proc/<pid>/cmdline``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return False
    if args and args[0].startswith("ray::"):
        return True
    dirs = _ray_dirs()
    return any(a.startswith(d) for a in args[:3] for d in dirs)


def process_tree(roots, *, skip=None) -> set[int]:
    """``roots`` and their descendants alive now, from ``/proc``; a process for which ``skip(pid)`` holds
    is left out with its descendants."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [int(r) for r in roots]
    while todo:
        pid = todo.pop()
        if pid in out or not os.path.exists(f"/proc/{pid}") or (skip is not None and skip(pid)):
            continue
        out.add(pid)
        todo += children.get(pid, [])
    return out


class ListenerScan:
    """The listening sockets that the code under test opens in the process trees of ``roots`` (default:
    this process), judged apart from the rest: the listeners those trees had when the scan was made are
    left out (a snapshot of their inodes: e.g. a Ray driver's server in a test process), and so are
    processes for which ``skip`` holds, with their descendants (default :func:`is_ray_process`: Ray's own
    raylets, GCS, agents and workers, when another test left a Ray cluster running). A socket the code
    under test binds afterwards, in these processes or in new ones below them, is reported wherever it
    listens (0.0.0.0 and :: included). :meth:`scan` as often as wanted; ``seen`` keeps every listener
    found, keyed by ``(pid, port)``."""

    def __init__(self, roots=None, *, skip=is_ray_process):
        self.roots = [os.getpid()] if roots is None else [int(r) for r in roots]
        self.skip = skip
        self.before = listener_inodes(self.pids())
        self.seen: dict[tuple[int, int], dict] = {}

    def pids(self, extra=()) -> set[int]:
        """The processes scanned: the trees of ``roots`` and ``extra``, less the skipped ones."""
        return process_tree([*self.roots, *extra], skip=self.skip)

    def scan(self, extra=()) -> list[dict]:
        """The listeners opened since the snapshot, now (also added to ``seen``); ``extra``: more roots."""
        now = listening_sockets(self.pids(extra), exclude=self.before)
        for s in now:
            self.seen[(s["pid"], s["port"])] = s
        return now

    def beyond(self, allowed=("127.0.0.1", "::1")) -> list[dict]:
        """The listeners seen on an address other than ``allowed``."""
        return [s for s in self.seen.values() if s["addr"] not in allowed]
