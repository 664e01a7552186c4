"""Resize latency of a live ElasticJob, a torchrun membership-change restart, and throughput vs world size.

* live resize: request -> first step done at the new size (``ElasticJob.resize(n).result()``), median
  over several resizes of a small MLP (scikit-learn digits), with a warm pool of worker processes;
* baseline in the same run: a cold restart at the new size (new processes via ``spawn``: start ->
  first step), i.e. what a stop-and-relaunch costs;
* torchrun: two elastic agents on localhost; agent B joins a running agent A (``--nnodes=1:2``); the
  restart is measured from B's launch to the first step at world size 2, and as the training gap
  (last step at size 1 -> first step at size 2);
* throughput (samples/s, median step) at a fixed global batch for each world size.

Target: median live resize latency under 2 s. Last line: ``RESULT {json}``.

``--store-connect N``: only the rendezvous part of a resize, N times per way of listening: a fresh store
and four client processes connecting to it at once (what every worker does after its Join), with the
store listening as torch's master does by itself (``TCPStore("127.0.0.1", 0, is_master=True)``: every
interface, IPv6 dual-stack ``[::]``) and as the job now makes it (an IPv4 socket bound to 127.0.0.1,
handed over with ``master_listen_fd``). Issue 16's ~5.05 s resize stalls were all in that connect: on
this (gVisor) machine a connect to the dual-stack listener now and then takes 5 s (see the closing
note of the issue for the counts).

Usage: python benchmarks/bench_resize.py [--quick] [--store-connect N]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")


def live_resizes(sizes, batch, steps_per_size):
    from elasticlab.elastic import ElasticJob

    job = ElasticJob(f"{DIGITS}:make_task", workers=1, warm=max(sizes), slots=max(sizes), global_batch=batch,
                     epochs=10_000, checkpoint_every=0)
    job.start()
    try:
        while job.status()["step"] < 5:
            if job.state == "failed":
                raise RuntimeError(job.status()["error"])
            time.sleep(0.05)
        lat = []
        for n in sizes:
            r = job.resize(n).result(timeout=120)
            lat.append(r["latency_s"])
            print(f"  resize -> {n}: {r['latency_s']:.3f} s (step {r['step']})", flush=True)
            while job.status()["step"] < r["step"] + steps_per_size:
                time.sleep(0.02)
        m = job.metrics()
        thr = {}
        for n in sorted(set(sizes) | {1}):
            t = [r["step_time"] for r in m if r["world_size"] == n and r["samples"] == r["global_batch"]]
            if len(t) > 2:
                thr[n] = batch / statistics.median(t[1:])
        return lat, thr
    finally:
        job.stop()


def cold_restart(n, batch):
    from elasticlab.elastic import ElasticJob

    t0 = time.perf_counter()
    job = ElasticJob(f"{DIGITS}:make_task", workers=n, warm=n, slots=n, global_batch=batch, epochs=10_000,
                     checkpoint_every=0, start_method="spawn")
    job.start()
    try:
        while job.status()["step"] < 1:
            if job.state == "failed":
                raise RuntimeError(job.status()["error"])
            time.sleep(0.02)
        return time.perf_counter() - t0
    finally:
        job.stop()


def torchrun_restart(tmp: Path, batch: int, max_steps: int = 400):
    from torch.distributed.elastic.utils.distributed import get_free_port

    port = get_free_port()
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}

    def agent(name):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=bench",
               "--rdzv_conf", "last_call_timeout=1", "--max-restarts=3", "--monitor-interval=0.1",
               DIGITS, "--checkpoint-dir", str(tmp / "ckpt"), "--epochs", "100",
               "--max-steps", str(max_steps), "--global-batch", str(batch), "--checkpoint-every", "10",
               "--step-delay", "0.01", "--log-steps"]
        return subprocess.Popen(cmd, stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                env=env, start_new_session=True)

    def events(kind):
        out = []
        for name in ("a", "b"):
            p = tmp / f"{name}.log"
            if p.exists():
                for line in p.read_text().splitlines():
                    if line.startswith(f'{{"event": "{kind}"'):
                        out.append(json.loads(line))
        return sorted(out, key=lambda r: r["time"])

    def steps():
        return events("step")

    procs = [agent("a")]
    try:
        end = time.monotonic() + 300
        while len(steps()) < 20:
            if procs[0].poll() is not None or time.monotonic() > end:
                raise RuntimeError("torchrun agent A failed:\n" + (tmp / "a.log").read_text()[-2000:])
            time.sleep(0.1)
        t_launch = time.time()
        procs.append(agent("b"))
        while not any(r["world_size"] == 2 for r in steps()):
            if time.monotonic() > end:
                raise RuntimeError("no step at world size 2:\n" + (tmp / "b.log").read_text()[-2000:])
            time.sleep(0.1)
        s = steps()
        first2 = next(r for r in s if r["world_size"] == 2)
        last1 = max(r["time"] for r in s if r["world_size"] == 1 and r["time"] < first2["time"])
        leave = events("leave")
        resume2 = [e for e in events("resume") if e["world_size"] == 2]
        lost = leave[0]["step"] - resume2[0]["step"] if leave and resume2 else None
        return {"launch_to_first_step_s": first2["time"] - t_launch, "training_gap_s": first2["time"] - last1,
                "lost_steps": lost}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _connect_client(conn, res_options):
    if res_options:
        os.environ["RES_OPTIONS"] = res_options  # before this process's first resolver call
    import datetime

    import torch.distributed as dist

    while True:
        port = conn.recv()
        if port is None:
            return
        t0 = time.perf_counter()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        conn.send(time.perf_counter() - t0)
        conn.recv()  # the next round: drop the connection first
        del store


def store_connect(n_rounds: int, clients: int = 4) -> dict:
    """Seconds for ``clients`` processes to connect to a fresh store, per setup (see the module
    docstring); one fresh store per round, as one per generation. ``before``: torch's own master (every
    interface, dual-stack) and clients with glibc's default resolver options; ``now``: the job's store
    (IPv4 127.0.0.1 socket) and its workers' ``RES_OPTIONS``."""
    import datetime
    import multiprocessing as mp

    import torch.distributed as dist

    from elasticlab.elastic.controller import JobController

    ctx = mp.get_context("spawn")
    holder = type("Opts", (), {"options": {"store_host": "127.0.0.1", "timeout_s": 30.0}})()
    setups = {"before": (lambda: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                               timeout=datetime.timedelta(seconds=30)), None),
              "now": (lambda: JobController._new_store(holder), "timeout:1 attempts:1")}
    pipes, procs = {}, []
    for name, (_, res_options) in setups.items():
        pipes[name] = []
        for _ in range(clients):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_connect_client, args=(b, res_options), daemon=True)
            p.start()
            pipes[name].append(a)
            procs.append(p)
    out = {k: [] for k in setups}
    try:
        for i in range(n_rounds):
            for name, (make, _) in setups.items():
                store = make()
                for c in pipes[name]:
                    c.send(store.port)
                out[name].append(max(c.recv() for c in pipes[name]))
                for c in pipes[name]:
                    c.send("next")
                del store
            if (i + 1) % 25 == 0:
                print(f"  {i + 1}/{n_rounds}: " + ", ".join(
                    f"{k} {sum(x > 1 for x in v)} over 1 s" for k, v in out.items()), flush=True)
    finally:
        for c in [c for v in pipes.values() for c in v]:
            with contextlib.suppress(Exception):
                c.send(None)
        for p in procs:
            p.join(5)
    return {k: {"rounds": len(v), "median_s": statistics.median(v), "max_s": max(v),
                "over_1s": sum(x > 1 for x in v), "slow_s": sorted(round(x, 3) for x in v if x > 1)}
            for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", default=os.environ.get("ELASTICLAB_QUICK") == "1")
    ap.add_argument("--store-connect", type=int, default=0, metavar="N",
                    help="only time N store connects per way of listening (the resize stalls)")
    a = ap.parse_args(argv)
    if a.store_connect:
        res = store_connect(a.store_connect)
        for k, v in res.items():
            print(f"  {k}: median {v['median_s'] * 1e3:.1f} ms, max {v['max_s']:.2f} s, "
                  f"{v['over_1s']} of {v['rounds']} over 1 s {v['slow_s']}")
        print("RESULT " + json.dumps({"store_connect": res, "load_average": os.getloadavg()}))
        return 0
    sizes = [2, 3, 1, 4, 2] if a.quick else [2, 3, 4, 1, 3, 2, 4, 1, 2]
    batch = 64
    print(f"load average before: {os.getloadavg()}", flush=True)
    print("live resizes (warm pool, forkserver workers):", flush=True)
    lat, thr = live_resizes(sizes, batch, steps_per_size=10 if a.quick else 30)
    med = statistics.median(lat)
    print(f"  median {med:.3f} s over {len(lat)} resizes", flush=True)
    print("baseline: cold restart at 2 workers (spawn, import torch, first step)...", flush=True)
    cold = cold_restart(2, batch)
    print(f"  {cold:.2f} s", flush=True)
    print("torchrun membership change (agent B joins agent A)...", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tr = torchrun_restart(Path(d), batch)
    print(f"  launch of B -> first step at world 2: {tr['launch_to_first_step_s']:.2f} s; "
          f"training gap {tr['training_gap_s']:.2f} s; steps lost {tr['lost_steps']}", flush=True)
    print("throughput at a fixed global batch of 64 (samples/s, median step):")
    for n, v in thr.items():
        print(f"  {n} workers: {v:8.0f}  (x{v / thr[1]:.2f} vs 1)")
    result = {"resize_latency_median_s": med, "resize_latencies_s": [round(x, 4) for x in lat],
              "target_s": 2.0, "meets_target": med < 2.0, "cold_restart_s": cold,
              "live_vs_cold_speedup": cold / med, "torchrun_restart_s": tr["launch_to_first_step_s"],
              "torchrun_training_gap_s": tr["training_gap_s"], "torchrun_lost_steps": tr["lost_steps"],
              "throughput_samples_per_s": {str(k): round(v, 1) for k, v in thr.items()},
              "load_average": os.getloadavg(), "quick": a.quick}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
