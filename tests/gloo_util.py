"""Run a test body on a small gloo process group (spawned, on 127.0.0.1); collect what each rank returns.

The teardown is the delicate part. A DDP model's reducer holds the process group, so
``destroy_process_group`` alone leaves the group alive until interpreter shutdown, and gloo's C++ threads
then die with the interpreter half gone ("terminate called without an active exception", SIGABRT; seen once
in CI). Here each rank's body returns before teardown (its models go with its frame), the ranks meet at a
barrier so that neither tears down while the other still has a collective in flight, and a garbage
collection frees what cycles kept, all while the interpreter is whole.
"""
import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, body, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        torch.save(body(rank), f"{out}/{rank}.pt")
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def run_gloo(body, world: int, out) -> list:
    """``body(rank)`` on ``world`` gloo processes; returns each rank's result (saved with torch.save)."""
    mp.start_processes(_rank, args=(body, world, free_port(), str(out)), nprocs=world, start_method="spawn")
    return [torch.load(f"{out}/{r}.pt", weights_only=True) for r in range(world)]
