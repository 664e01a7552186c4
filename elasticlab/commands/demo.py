"""``elasticlab demo``: a short elastic run in the terminal, with a progress bar."""
from __future__ import annotations

NAME = "demo"
HELP = "a short elastic DDP run on scikit-learn's digits (resizes 1->2->3->1) with a progress bar"

#: The job's events written above the progress bar.
SHOWN_EVENTS = ("resize", "fault", "restart", "error")


def add_arguments(parser) -> None:
    parser.add_argument("--schedule", default="30:2,70:3,110:1",
                        help="resizes 'STEP:N,...' (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    parser.add_argument("--global-batch", type=int, default=32,
                        help="fixed global batch, re-split over the workers at each resize (default 32)")
    parser.add_argument("--step-delay", type=float, default=0.01,
                        help="sleep per step, s, so that the resizes can be watched (default 0.01)")


def run(args) -> int:
    import math
    import sys
    import time
    from pathlib import Path

    from tqdm import tqdm

    import elasticlab
    from elasticlab.elastic import ElasticJob, JobState
    from elasticlab.elastic.job import parse_schedule
    from elasticlab.elastic.states import TERMINAL

    script = Path(elasticlab.__file__).resolve().parent.parent / "examples" / "digits.py"
    if not script.is_file():
        print(f"elasticlab demo: {script} is missing (run from a source checkout)", file=sys.stderr)
        return 2
    try:
        schedule = parse_schedule(args.schedule)
        job = ElasticJob(f"{script}:make_task", workers=1, schedule=schedule, epochs=args.epochs,
                         global_batch=args.global_batch, warm=max([1, *schedule.values()]),
                         step_delay_s=args.step_delay, checkpoint_every=20)
    except ValueError as e:
        print(f"elasticlab demo: {e}", file=sys.stderr)
        return 2
    total = args.epochs * math.ceil(1797 / args.global_batch)
    print(f"starting {job.warm} worker processes (importing torch takes a few seconds each)...")
    job.start()
    seen = 0
    with tqdm(total=total, unit="step", dynamic_ncols=True, mininterval=0.25) as bar:
        try:
            while job.state not in TERMINAL:
                time.sleep(0.1)
                st = job.status()
                bar.update(st["step"] - bar.n)
                if st["loss"] is not None:
                    workers = st["world_size"] or st["target_world_size"]
                    bar.set_postfix(workers=workers, loss=f"{st['loss']:.3f}",
                                    samples_s=f"{st['samples_per_s'] or 0:.0f}")
                for e in job.events(seen):
                    seen += 1
                    if e["kind"] in SHOWN_EVENTS:
                        fields = {k: v for k, v in e.items() if k not in ("time", "t", "kind")}
                        bar.write(f"[{e['t']:7.2f}s] {e['kind']}: {fields}")
        except KeyboardInterrupt:
            bar.write("interrupted: stopping the job at the next step boundary")
        finally:
            job.stop()
        bar.update(job.status()["step"] - bar.n)
    st = job.status()
    loss = f", final loss {st['loss']:.4f}" if st["loss"] is not None else ""
    print(f"{job.state}: {st['step']} steps{loss}")
    return 0 if job.state in (JobState.FINISHED, JobState.STOPPED) else 1
