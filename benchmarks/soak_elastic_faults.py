"""Fault-injection soak of the elastic runtime: random faults over long jobs, then exactly-once checks.

Jobs of ``--faults-per-job`` faults each run one after another (a batch of ``--jobs-at-once`` at a time)
until ``--faults`` faults (default 200) have been injected. Each job trains a small synthetic task for
``--epochs`` epochs on 2 workers (3 warm, 3 slots) with a sample record, and its faults are drawn from:

* ``kill``       SIGKILL a random member of the running generation;
* ``kill_form``  ask for a resize and SIGKILL a random member of the new generation as soon as it is
                 announced (0-50 ms later: before, while or just after it forms);
* ``corrupt``    pause, damage the newest checkpoint (truncate, flip a byte, or a valid checksum around a
                 pickle ``weights_only=True`` refuses) -- one time in five every checkpoint -- and resume;
* ``pause``      pause and resume (at a random size);
* ``resize``     resize to a random size.

And one fault set when each job is made, before the others: rank 1 of the first generation dies after the
update of its first checkpoint step, before it sends that step's sample rows, while rank 0 checkpoints it
(``inject_faults`` ``stepped:N``; the drawn faults come at steps spread over the rest of the job).
``record_guarded_restarts`` counts the restarts that went on from an older checkpoint because the record
lacked a rank's rows of the steps after it.

A run is *good* when the job finished, the sample record shows every sample of every epoch exactly once
(replayed steps counted once: the latest generation's rows of a step are the ones that count) and no
rank drift (in every generation, every step was taken by ranks 0..world_size-1, once each, at one world
size). Recovery time: from the fault (the kill, the resume request) to the first step of the generation
that follows it. Prints a summary and a last line ``RESULT {json}``.

Usage: python benchmarks/soak_elastic_faults.py [--faults 200] [--faults-per-job 10] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = os.path.abspath(__file__)
N_SAMPLES = 1024
KINDS = ("kill", "kill_form", "corrupt", "pause", "resize")


def make_task(n: int = N_SAMPLES):
    """The soak's task: a small MLP on ``n`` synthetic 16-dimensional points of 4 classes."""
    import torch

    from elasticlab.elastic import Task

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return Task(model=model, dataset=(x, y), base_batch=32,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))


class _Refused:
    """Pickled into a checkpoint that ``torch.load(weights_only=True)`` must refuse."""


def damage(path: Path, how: str) -> None:
    import hashlib
    import io

    import torch

    from elasticlab.elastic.checkpoint import MAGIC

    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        i = len(data) - 10
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    else:  # checksum good, pickle refused
        buf = io.BytesIO()
        torch.save({"model": _Refused()}, buf)
        payload = buf.getvalue()
        path.write_bytes(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


def first_step_after(job, generation: int, t0: float, timeout: float = 180.0) -> float | None:
    """Seconds from ``t0`` to the first step of a generation after ``generation`` (None: none came)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        later = [m for m in job.metrics() if m["generation"] > generation]
        if later:
            return max(0.0, later[0]["time"] - t0)
        if job.state in ("failed", "finished", "stopped"):
            return None
        time.sleep(0.01)
    return None


def inject(job, kind: str, rng: random.Random, slots: int) -> tuple[str, float | None]:
    """Apply one fault; returns (what was done, recovery seconds or None)."""
    st = job.status()
    if st.state != "running":
        return "skipped", None
    gen = st.generation
    if kind == "kill":
        pids = job.worker_pids()
        if not pids:
            return "skipped", None
        rank = rng.choice(sorted(pids))
        t0 = time.time()
        try:
            os.kill(pids[rank], signal.SIGKILL)
        except ProcessLookupError:
            return "skipped", None
        return f"kill rank {rank}", first_step_after(job, gen, t0)
    if kind == "kill_form":
        n = rng.choice([k for k in range(1, slots + 1) if k != st.world_size])
        fut = job.resize(n)
        end = time.monotonic() + 60
        while job.status().generation == gen and time.monotonic() < end and job.state != "failed":
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.05))
        pids = job.worker_pids()
        new_gen = job.status().generation
        if not pids or new_gen == gen:
            return "skipped", None
        rank = rng.choice(sorted(pids))
        t0 = time.time()
        try:
            os.kill(pids[rank], signal.SIGKILL)
        except ProcessLookupError:
            pass
        rec = first_step_after(job, new_gen, t0)
        try:
            fut.result(timeout=120)
        except Exception:
            pass
        return f"kill rank {rank} of generation {new_gen} while forming ({n} workers)", rec
    if kind in ("corrupt", "pause"):
        job.pause().result(timeout=120)
        what = "pause/resume"
        if kind == "corrupt":
            ckdir = job.checkpoint_dir
            steps = ckdir.steps()
            targets = steps if rng.random() < 0.2 else steps[-1:]
            how = rng.choice(["truncate", "flip", "unloadable"])
            for s in targets:
                damage(ckdir.path(s), how)
            what = f"corrupt ({how}) {'all' if len(targets) > 1 else 'newest'} of {len(steps)} checkpoints"
        else:
            time.sleep(rng.uniform(0, 0.5))
        n = rng.randint(1, slots)
        t0 = time.time()
        job.resume(n).result(timeout=180)
        return f"{what}, resume at {n}", first_step_after(job, gen, t0)
    n = rng.choice([k for k in range(1, slots + 1) if k != st.world_size])
    r = job.resize(n).result(timeout=180)
    return f"resize to {n}", r["latency_s"]


def check_run(record: Path, epochs: int) -> dict:
    """Exactly-once and rank-drift checks from a job's sample record."""
    from elasticlab.elastic import check_exactly_once, effective_rows
    from elasticlab.elastic.sampler import read_record

    rows = read_record(record)
    rep = check_exactly_once(rows, N_SAMPLES)
    complete = all(rep["epochs"].get(e, {}).get("complete") and not rep["epochs"][e]["missing"]
                   for e in range(epochs))
    eff = effective_rows(rows)
    kept = {(r["generation"], r["step"]) for r in eff}
    drift, first = [], {}
    by: dict = {}
    for r in rows:
        by.setdefault((r["generation"], r["step"]), []).append(r)
        first.setdefault((r["generation"], r["rank"]), r["step"])
    for (g, s), rs in by.items():
        sizes = {r["world_size"] for r in rs}
        ranks = sorted(r["rank"] for r in rs)
        n = max(sizes)
        # a step that counts needs every rank once; a rolled-back one may lack the row of a rank
        # killed before it could send it, but never has a rank twice or two world sizes
        if len(sizes) != 1 or len(set(ranks)) != len(ranks) or not set(ranks) <= set(range(n)) or (
                (g, s) in kept and ranks != list(range(n))):
            drift.append((g, s, ranks))
    for g in {g for g, _ in by}:  # every rank of a generation starts at the same step
        starts = {s for (gg, _), s in first.items() if gg == g}
        if len(starts) != 1:
            drift.append((g, "first steps", sorted(starts)))
    return {"exactly_once": bool(rep["ok"] and complete), "drift": drift[:5], "n_drift": len(drift),
            "duplicates": sum(len(v["duplicates"]) for v in rep["epochs"].values()),
            "missing": sum(len(v["missing"]) for v in rep["epochs"].values()),
            "replayed_rows": len(rows) - len(eff)}


def run_job(i: int, n_faults: int, args, tmp: Path, progress) -> dict:
    from elasticlab.elastic import ElasticJob

    rng = random.Random(args.seed * 100_003 + i)
    d = tmp / f"job{i}"
    record = d / "samples.jsonl"
    d.mkdir()
    slots = 3
    job = ElasticJob(f"{HERE}:make_task", workers=2, warm=slots, slots=slots, epochs=args.epochs,
                     checkpoint_every=args.checkpoint_every, checkpoint_dir=str(d / "ck"),
                     record_samples=str(record), step_delay_s=args.step_delay, timeout_s=20,
                     max_failed_generations=8, goodput_refit_s=0,
                     inject_faults=[(f"stepped:{args.checkpoint_every}", 1, 1)])
    steps_per_epoch = -(-N_SAMPLES // 32)
    total = steps_per_epoch * args.epochs
    faults, t_start = [], time.monotonic()
    job.start()
    try:
        for k in range(n_faults):
            target = args.checkpoint_every + int((total - args.checkpoint_every) * (k + 1) / (n_faults + 2))
            end = time.monotonic() + 300
            while time.monotonic() < end:
                m = job.metrics()
                hw = max((r["step"] for r in m), default=0)
                if hw >= target or job.state in ("failed", "finished", "stopped"):
                    break
                time.sleep(0.02)
            if job.state != "running":
                break
            kind = rng.choice(KINDS)
            try:
                what, rec = inject(job, kind, rng, slots)
            except Exception as e:  # a request failed: the run will be judged by its end state
                what, rec = f"error: {e!r}", None
            if what != "skipped":
                faults.append({"kind": kind, "what": what, "recovery_s": rec})
                progress.update(1)
        job.wait(600)
        st = job.status()
        guarded = sum(e["kind"] == "restart" and e.get("recorded_through") is not None
                      and e["recorded_through"] < e["last_step"] for e in job.events())
        out = {"job": i, "state": st.state, "error": st.error, "faults": faults, "lost_steps": st.lost_steps,
               "record_guarded_restarts": guarded,
               "replays": st.replays, "steps": st.step, "wall_s": round(time.monotonic() - t_start, 1)}
    finally:
        job.stop()
    out.update(check_run(record, args.epochs) if record.exists() else {"exactly_once": False, "n_drift": -1})
    out["good"] = out["state"] == "finished" and out["exactly_once"] and out["n_drift"] == 0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=200, help="faults to inject in all (default 200)")
    ap.add_argument("--faults-per-job", type=int, default=10)
    ap.add_argument("--jobs-at-once", type=int, default=1, help="jobs run side by side (default 1)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=8)
    ap.add_argument("--step-delay", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.faults < 1 or a.faults_per_job < 1 or a.jobs_at_once < 1:
        ap.error("--faults, --faults-per-job and --jobs-at-once must be >= 1")
    from tqdm import tqdm

    n_jobs = -(-a.faults // a.faults_per_job)
    per_job = [min(a.faults_per_job, a.faults - j * a.faults_per_job) for j in range(n_jobs)]
    print(f"{a.faults} faults in {n_jobs} jobs ({a.epochs} epochs of {N_SAMPLES} samples each), "
          f"load average {os.getloadavg()}", flush=True)
    runs = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elasticlab-soak-") as tmp, \
            tqdm(total=a.faults, desc="faults", file=sys.stderr) as progress, \
            ThreadPoolExecutor(a.jobs_at_once) as pool:
        futs = [pool.submit(run_job, j, per_job[j], a, Path(tmp), progress) for j in range(n_jobs)]
        for f in futs:
            r = f.result()
            runs.append(r)
            tqdm.write(f"job {r['job']}: {r['state']}, {len(r['faults'])} faults, exactly-once "
                       f"{r['exactly_once']}, rank drift {r['n_drift']}, lost steps {r['lost_steps']}, "
                       f"replays {r['replays']}, {r['wall_s']} s{' -- ' + r['error'] if r['error'] else ''}",
                       file=sys.stderr)
    faults = [f for r in runs for f in r["faults"]]
    rec = sorted(f["recovery_s"] for f in faults if f["recovery_s"] is not None)

    def dist(xs):
        if not xs:
            return None
        xs = sorted(xs)
        q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
        return {"n": len(xs), "min": round(xs[0], 3), "median": round(statistics.median(xs), 3),
                "p90": round(q(0.9), 3), "max": round(xs[-1], 3)}

    by_kind = {k: dist([f["recovery_s"] for f in faults if f["kind"] == k and f["recovery_s"] is not None])
               for k in KINDS}
    result = {"runs": len(runs), "faults": len(faults),
              "faults_by_kind": dict(Counter(f["kind"] for f in faults)),
              "runs_good": sum(r["good"] for r in runs),
              "runs_finished": sum(r["state"] == "finished" for r in runs),
              "runs_exactly_once": sum(bool(r["exactly_once"]) for r in runs),
              "runs_no_drift": sum(r["n_drift"] == 0 for r in runs),
              "no_recovery_measured": sum(f["recovery_s"] is None for f in faults),
              "recovery_s": dist(rec), "recovery_s_by_kind": by_kind,
              "slowest_recoveries": sorted(({"s": round(f["recovery_s"], 2), "what": f["what"]}
                                            for f in faults if f["recovery_s"] is not None),
                                           key=lambda x: -x["s"])[:5],
              "lost_steps": sum(r["lost_steps"] for r in runs), "replays": sum(r["replays"] for r in runs),
              "record_guarded_restarts": sum(r["record_guarded_restarts"] for r in runs),
              "bad_runs": [{k: r[k] for k in ("job", "state", "error", "exactly_once", "n_drift", "drift",
                                               "duplicates", "missing")} for r in runs if not r["good"]],
              "wall_s": round(time.monotonic() - t0, 1), "load_average": os.getloadavg(), "seed": a.seed}
    print(f"{result['runs_good']} of {len(runs)} runs ended with every sample of every epoch seen exactly "
          f"once (replays counted once) and no rank drift; {len(faults)} faults "
          f"{result['faults_by_kind']}; recovery {result['recovery_s']}")
    print("RESULT " + json.dumps(result))
    return 0 if result["runs_good"] == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
