"""One worker slot of a job on a Ray node: an actor holding a :class:`~elasticlab.elastic.trainer.Trainer`.

The actor builds its task once (torch imported once per actor, as a pool worker does) and then runs
generations with the elastic package's own generation loop (``elasticlab.elastic.worker.run_generation``:
store, group, checkpoint load/save, step commands, sample rows). That loop talks to a pipe; here the pipe
is :class:`Mailbox`, which the job's controller drains (:meth:`RayWorker.drain`) and feeds
(:meth:`RayWorker.control`) from the driver while :meth:`RayWorker.run` trains -- the actor is threaded
(``max_concurrency`` > 1) for that.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading


class Mailbox:
    """The worker's end of the job's pipe: ``send`` buffers for :meth:`take`, ``poll``/``recv`` read what
    :meth:`put` delivered (the ``multiprocessing.Connection`` methods the generation loop uses)."""

    def __init__(self):
        self._out: list = []
        self._lock = threading.Lock()
        self._in: queue.Queue = queue.Queue()

    def send(self, msg) -> None:
        with self._lock:
            self._out.append(msg)

    def take(self) -> list:
        with self._lock:
            out, self._out = self._out, []
        return out

    def put(self, msg) -> None:
        self._in.put(msg)

    def poll(self) -> bool:
        return not self._in.empty()

    def recv(self):
        return self._in.get_nowait()


class RayWorker:
    """The actor class (made remote by :class:`~elasticlab.cluster.ray.job.RayJob`); see the module doc."""

    def __init__(self, worker_id: int, entrypoint: str, entry_kwargs: dict, options: dict):
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # c10d's reverse lookup of the store
        import torch

        torch.set_num_threads(int(options.get("threads", 1)))
        import elasticlab.gns.ddp  # noqa: F401  (imported now, not on the first generation)
        from elasticlab.elastic.task import build
        from elasticlab.elastic.trainer import Trainer

        torch.manual_seed(options["seed"])
        self.worker_id = int(worker_id)
        self.trainer = Trainer(build(entrypoint, entry_kwargs), options)
        self.mailbox = Mailbox()

    def where(self) -> dict:
        """The node this actor runs on: Ray's node id, the node's address, the process id, the device it
        trains on and the GPUs Ray gave it (``CUDA_VISIBLE_DEVICES``)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "device": str(self.trainer.device),
                "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def run(self, join) -> int:
        """Train as ``join.rank`` of generation ``join.generation`` until it ends; returns the generation."""
        from elasticlab.elastic import messages as M
        from elasticlab.elastic.worker import run_generation

        while self.mailbox.poll():  # a command meant for an earlier generation
            self.mailbox.recv()
        try:
            run_generation(self.trainer, self.mailbox, join)
        except Exception as e:
            import traceback

            where = "".join(traceback.format_exception(e)[-3:]).strip()
            self.mailbox.send(M.Error(self.worker_id, join.generation, f"{e!r}\n{where}"))
        finally:
            with contextlib.suppress(Exception):
                self.trainer.leave()
        self.mailbox.send(M.Idle(self.worker_id, join.generation))
        return join.generation

    def control(self, msg) -> None:
        """Deliver a :class:`~elasticlab.elastic.messages.Control` to the generation loop (rank 0)."""
        self.mailbox.put(msg)

    def drain(self) -> list:
        """The messages sent since the last drain (Step, Samples, Checkpointed, Left, Finished, ...)."""
        return self.mailbox.take()
