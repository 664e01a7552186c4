"""Overhead of ``GNSMonitor`` under FSDP2 with gradient accumulation, on gloo processes on 127.0.0.1.

An MLP (``--layers`` Linear+GELU of width ``--width``, each an FSDP2 unit) on ``--world`` processes; a step is
zero_grad, ``--micro-batches`` k forwards and backwards of ``--batch`` examples each (losses divided by k),
SGD step. Methods, timed interleaved round by round in the same run: ``plain`` (a model of its own, without
the monitor's hooks) and ``monitor`` (every step measured, per-example form over every micro-batch). Wall time
of rank 0 between barriers; per method the minimum over ``--rounds`` of the mean of ``--steps`` steps. Also
counted: the all-reduces a step issues (FSDP2 itself gathers and reduce-scatters, so on a 1-D mesh every
all-reduce is the monitor's). Last line: ``RESULT {json}``.

    python benchmarks/bench_gns_fsdp2.py [--micro-batches 8] [--rounds 5] [--steps 5]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

METHODS = ("plain", "monitor")


def build(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    mods = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
    net = nn.Sequential(*(m for lin in mods for m in (lin, nn.GELU())), nn.Linear(args.width, 10))
    mesh = init_device_mesh("cpu", (args.world,))
    for m in mods:
        fully_shard(m, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def rank_main(rank, args, port, out):
    """One process: :func:`measure`, then the teardown of tests/gloo_util.py (the models gone with its frame,
    the ranks at a barrier, cycles collected, then the group destroyed: gloo's threads may otherwise abort the
    process at exit)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        res = measure(rank, args)
        if rank == 0:
            torch.save(res, f"{out}/result.pt")
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def measure(rank, args) -> dict:
    """Both methods' best step times (ms), the all-reduces of one step of each, the monitor's B_simple."""
    from elasticlab.gns import GNSMonitor
    nets = {m: build(args) for m in METHODS}     # (plain: a model without the monitor's hooks)
    opts = {m: torch.optim.SGD(nets[m].parameters(), lr=1e-4) for m in METHODS}
    g = torch.Generator().manual_seed(rank)
    parts = [torch.randn(args.batch, args.width, generator=g) for _ in range(args.micro_batches)]
    monitor, count, real = GNSMonitor(nets["monitor"]), [0], dist.all_reduce

    def counted(*a, **kw):
        count[0] += 1
        return real(*a, **kw)

    def step(method):
        net, opt = nets[method], opts[method]
        opt.zero_grad()
        with monitor.step() if method == "monitor" else contextlib.nullcontext():
            for x in parts:
                (net(x).pow(2).mean() / len(parts)).backward()
        opt.step()

    reduces = {}
    dist.all_reduce = counted
    for m in METHODS:                     # warm-up (the monitor's first step runs eagerly) and the count
        step(m)
        before = count[0]
        step(m)
        reduces[m] = count[0] - before
    dist.all_reduce = real
    best = dict.fromkeys(METHODS, float("inf"))
    for _ in range(args.rounds):
        for m in METHODS:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(m)
            dist.barrier()
            best[m] = min(best[m], (time.perf_counter() - t0) / args.steps)
    return {"ms": {m: 1e3 * v for m, v in best.items()}, "all_reduces": reduces, "b_simple": monitor.b_simple}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="examples per micro-batch and process")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    for name in ("world", "micro_batches", "batch", "width", "layers", "rounds", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(args, port, out), nprocs=args.world, start_method="spawn")
        res = torch.load(f"{out}/result.pt", weights_only=True)
    res["ratio"] = res["ms"]["monitor"] / res["ms"]["plain"]
    res["config"] = {k: getattr(args, k) for k in ("world", "micro_batches", "batch", "width", "layers")}
    print(f"FSDP2 x{args.world} gloo, k={args.micro_batches} micro-batches of {args.batch}, "
          f"{args.layers}x{args.width} MLP")
    for m in METHODS:
        print(f"  {m:8s} {res['ms'][m]:8.2f} ms/step   all-reduces/step {res['all_reduces'][m]}")
    print(f"  monitor / plain = {res['ratio']:.3f}")
    print("RESULT " + json.dumps(res))
    return res


if __name__ == "__main__":
    main()
