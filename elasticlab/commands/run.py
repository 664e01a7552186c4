"""``elasticlab run SCRIPT``: a scripted elastic experiment on local workers, resizing at given steps."""
from __future__ import annotations

NAME = "run"
HELP = "run a training script's task as an elastic local DDP job, resizing at given steps"

#: The job's events printed (as JSON lines) before the RESULT line.
PRINTED_EVENTS = ("generation", "resize", "fault", "restart", "checkpoint_corrupt", "record_gap", "error",
                  "abort", "failed")


def record_check(record: str, checkpoint_dir, epochs: int | None) -> dict | None:
    """The sample record's exactly-once check (:func:`elasticlab.elastic.check_exactly_once`; ``epochs``: of
    a job that ran them out, each must be whole), its sample count read from the newest checkpoint's
    sampler: ``{"ok", "missing", "duplicates"}`` (counts over the epochs that must be whole), None without a
    checkpoint."""
    from elasticlab.elastic import CheckpointDir, check_exactly_once
    from elasticlab.elastic.checkpoint import load
    from elasticlab.elastic.sampler import read_record

    path, _ = CheckpointDir(checkpoint_dir).latest()
    if path is None:
        return None
    n = int(load(path)["sampler"]["num_samples"])
    rep = check_exactly_once(read_record(record), n, epochs=epochs)
    whole = [e for e in rep["epochs"].values() if e["complete"]]   # (not a last epoch that may be short)
    return {"ok": rep["ok"], "missing": sum(len(e["missing"]) for e in whole),
            "duplicates": sum(len(e["duplicates"]) for e in rep["epochs"].values())}


def add_arguments(parser) -> None:
    from elasticlab.elastic.states import OnNoCheckpoint  # no torch: cheap enough for `elasticlab --help`

    parser.add_argument("script", help="'path/to/script.py[:make_task]' or 'package.module:function'")
    parser.add_argument("--workers", type=int, default=1, help="initial number of workers (default 1)")
    parser.add_argument("--schedule", default=None,
                        help="resizes 'STEP:N,STEP:N,...': from step STEP+1 on, N workers")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many optimizer steps (default: when the epochs are done)")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=int, default=None,
                       help="fixed global batch (default: the task's base batch)")
    batch.add_argument("--per-worker-batch", type=int, default=None,
                       help="fixed per-worker batch with the Dynamic-SGD LR ramp instead")
    parser.add_argument("--record-samples", default=None, metavar="FILE",
                        help="write the JSONL sample record {epoch, step, rank, world_size, indices}")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints go (default: a temporary folder removed at the end)")
    parser.add_argument("--checkpoint-every", type=int, default=20,
                        help="checkpoint every this many steps (0: at the start, resizes and end only)")
    parser.add_argument("--slots", type=int, default=None, help="worker slots (default: 2 per CPU core)")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (slows a demo down)")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart from the newest checkpoint after a worker exception, at most this "
                             "many times (default 0: the first exception fails the job)")
    parser.add_argument("--on-no-checkpoint", choices=[p.value for p in OnNoCheckpoint], default=None,
                        help="with no loadable checkpoint left: restart from the initial state (default) "
                             "or fail")


def _missing_module(entrypoint: str) -> str | None:
    """Why a 'package.module:function' entrypoint's module cannot be imported here (so neither by the workers,
    which would each fail with a traceback), or None; scripts ('path.py:function') are checked by the job."""
    import importlib.util

    mod = entrypoint.partition(":")[0]
    if not mod or mod.endswith(".py"):
        return None
    try:
        found = importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):                      # a missing parent package, or a malformed name
        found = False
    if found:
        return None
    return (f"entrypoint module {mod!r} cannot be imported (not on the Python path; for a script give its "
            "path ending in .py, e.g. examples/digits.py)")


def run(args) -> int:
    import json
    import os
    import sys
    import time

    from tqdm import tqdm

    from elasticlab.checks import seconds
    from elasticlab.elastic import ElasticJob, FixedPerWorkerBatch, JobState
    from elasticlab.elastic.job import parse_schedule
    from elasticlab.elastic.states import OnNoCheckpoint

    script = args.script if ":" in args.script else f"{args.script}:make_task"
    why = _missing_module(script)
    if why:
        print(f"elasticlab run: {why}", file=sys.stderr)
        return 2
    if args.record_samples and os.path.exists(args.record_samples) and os.path.getsize(args.record_samples):
        print(f"elasticlab run: --record-samples {args.record_samples!r} exists and is not empty; a record "
              "is one run's, so remove it or name another file", file=sys.stderr)
        return 2
    try:
        seconds("--timeout", args.timeout)
        schedule = parse_schedule(args.schedule)
        policy = None if args.per_worker_batch is None else FixedPerWorkerBatch(args.per_worker_batch)
        job = ElasticJob(script, workers=args.workers, schedule=schedule, epochs=args.epochs,
                         max_steps=args.max_steps, global_batch=args.global_batch, policy=policy,
                         record_samples=args.record_samples or False, checkpoint_dir=args.checkpoint_dir,
                         checkpoint_every=args.checkpoint_every, slots=args.slots,
                         warm=max([args.workers, *schedule.values()]), step_delay_s=args.step_delay,
                         max_restarts=args.max_restarts,
                         on_no_checkpoint=args.on_no_checkpoint or OnNoCheckpoint.RESTART)
    except ValueError as e:
        print(f"elasticlab run: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    job.start()
    end = time.monotonic() + args.timeout
    bar = tqdm(desc="training", unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=not sys.stderr.isatty() and os.environ.get("ELASTICLAB_PROGRESS") != "1")
    try:  # a progress bar on stderr while it trains (stdout keeps the events and the RESULT line)
        finished = False
        while not finished and time.monotonic() < end:
            finished = job.wait(min(0.5, max(end - time.monotonic(), 0.0)))
            st = job.status()
            bar.update(max(int(st["step"]) - bar.n, 0))
            bar.set_postfix(workers=st["world_size"], state=st["state"], refresh=False)
    except KeyboardInterrupt:
        finished = False
    finally:
        bar.close()
        job.stop()
    wall = time.perf_counter() - t0
    m = job.metrics()
    ev = job.events()
    for e in ev:
        if e["kind"] in PRINTED_EVENTS:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in e.items() if k not in ("time", "traceback")}))
    train_s = sum(r["step_time"] for r in m)
    result = {"finished": bool(finished and job.state == JobState.FINISHED),
              "steps": m[-1]["step"] if m else 0,
              "resizes": [[e["from_size"], e["to_size"], e["step"]] for e in ev if e["kind"] == "resize"],
              "resize_latency_s": [round(e["latency_s"], 4) for e in ev if e["kind"] == "resize"],
              "final_loss": m[-1]["loss"] if m else None,
              "samples_per_s": sum(r["samples"] for r in m) / train_s if train_s else None,
              "world_sizes": sorted({r["world_size"] for r in m}), "lost_steps": job.status()["lost_steps"],
              "wall_s": round(wall, 2), "record_samples": job.record_path, "state": job.state,
              "error": job.status()["error"], "replays": job.status()["replays"]}
    if job.record_path:  # (a job cut by --max-steps may end inside an epoch)
        ran_out = result["finished"] and args.max_steps is None
        result["exactly_once"] = record_check(job.record_path, job.checkpoint_dir.directory,
                                              args.epochs if ran_out else None)
    last = result["steps"]
    never = {k: v for k, v in sorted(schedule.items()) if k >= last}
    if never and result["finished"]:  # STEP:N acts from step STEP+1 on
        result["schedule_not_reached"] = [f"{k}:{v}" for k, v in never.items()]
        print(f"elasticlab run: warning: training ended at step {last}, so the schedule entries "
              f"{', '.join(result['schedule_not_reached'])} never took effect", file=sys.stderr)
    print("RESULT " + json.dumps(result))
    if job.state == JobState.FAILED:
        st = job.status()
        print(f"elasticlab run: the job failed: {st['error']}", file=sys.stderr)
        if st["traceback"]:
            print(st["traceback"], file=sys.stderr)
    elif not finished:
        print(f"elasticlab run: the job did not finish within --timeout {args.timeout:g} s "
              f"(state {job.state})", file=sys.stderr)
    return 0 if result["finished"] else 1
