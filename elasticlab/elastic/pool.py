"""The pool of long-lived worker processes of an :class:`~elasticlab.elastic.ElasticJob`: spawn, drain
messages, notice deaths, end. Each runs :func:`elasticlab.elastic.worker.pool_worker` and talks to the
controller over one pipe in :mod:`elasticlab.elastic.messages`.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time

from elasticlab.elastic import messages as M
from elasticlab.elastic.states import WorkerState
from elasticlab.elastic.worker import pool_worker


def default_slots(device: str | None = None) -> int:
    """Worker slots here: one per GPU, else two per CPU core (gloo tolerates 2x oversubscription)."""
    try:
        import torch

        if torch.cuda.is_available() and device != "cpu":
            return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        pass
    return 2 * (os.cpu_count() or 1)


def worker_context(start_method: str):
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


class PoolWorker:
    """One worker process as the controller sees it: its pipe, state, pid and rank in the generation."""

    __slots__ = ("id", "proc", "conn", "state", "pid", "rank")

    def __init__(self, wid, proc, conn):
        self.id, self.proc, self.conn = wid, proc, conn
        self.state, self.pid, self.rank = WorkerState.STARTING, proc.pid, None


class WorkerPool:
    """The worker processes of one job, by id; each is started with the same task and options."""

    def __init__(self, start_method: str, entrypoint: str, entry_kwargs: dict, options: dict,
                 lock: threading.RLock):
        self._ctx = worker_context(start_method)
        self._args = (entrypoint, entry_kwargs, options)
        self._lock = lock  # the job's: status() reads the pool from the caller's thread
        self.workers: dict[int, PoolWorker] = {}
        self._next_id = 0

    def values(self) -> list[PoolWorker]:
        return list(self.workers.values())

    def idle(self) -> list[PoolWorker]:
        """Idle workers, oldest first."""
        return sorted((w for w in self.workers.values() if w.state == WorkerState.IDLE), key=lambda w: w.id)

    def spawn_upto(self, n: int) -> None:
        """Start processes until ``n`` are alive."""
        alive = [w for w in self.workers.values() if w.state != WorkerState.DEAD]
        for _ in range(n - len(alive)):
            parent, child = self._ctx.Pipe()
            wid = self._next_id
            self._next_id += 1
            proc = self._ctx.Process(target=pool_worker, name=f"elasticlab-worker-{wid}", daemon=True,
                                     args=(child, wid, *self._args))
            proc.start()
            child.close()
            with self._lock:
                self.workers[wid] = PoolWorker(wid, proc, parent)

    def waitables(self) -> list:
        """The pipes and process sentinels of the live workers (for ``multiprocessing.connection.wait``)."""
        objs = []
        for w in list(self.workers.values()):
            if w.state != WorkerState.DEAD:
                objs += [w.conn, w.proc.sentinel]
        return objs

    @staticmethod
    def drain(w: PoolWorker, on_message) -> None:
        """Hand every message waiting on ``w``'s pipe to ``on_message(w, msg)``."""
        try:
            while w.conn.poll():
                on_message(w, w.conn.recv())
        except (EOFError, OSError):
            pass

    @staticmethod
    def bury(w: PoolWorker) -> tuple:
        """Mark ``w`` dead, collect its exit status; returns ``(state it was in, exit code)``."""
        was = w.state
        w.state = WorkerState.DEAD
        w.proc.join(2.0)  # the sentinel can fire just before the exit status is there to collect
        with contextlib.suppress(Exception):
            w.conn.close()
        return was, w.proc.exitcode

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask every live worker to exit, wait up to ``timeout`` s, then kill what is left."""
        for w in self.workers.values():
            if w.state != WorkerState.DEAD:
                with contextlib.suppress(Exception):
                    w.conn.send(M.Exit())
        end = time.monotonic() + timeout
        for w in self.workers.values():
            w.proc.join(max(0.0, end - time.monotonic()))
        self.kill_all()

    def kill_all(self) -> None:
        """Kill every process still alive; all are dead afterwards."""
        for w in list(self.workers.values()):
            if w.proc.is_alive():
                with contextlib.suppress(Exception):
                    w.proc.kill()
                w.proc.join(5)
            w.state = WorkerState.DEAD
