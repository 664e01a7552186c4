"""``elasticlab simulate``: replay a workload on a simulated cluster under one scheduling policy."""
from __future__ import annotations

NAME = "simulate"
HELP = ("replay a workload (a Pollux-artifact CSV, or a whole cluster trace such as Philly) on a simulated "
        "GPU cluster under a scheduling policy")


class _PolicyNames:
    """The names of :data:`elasticlab.alloc.policies.POLICIES`, sorted; imported when argparse first asks
    (so ``elasticlab --help`` does not import numba)."""

    def _names(self) -> list[str]:
        from elasticlab.alloc.policies import policy_names

        return policy_names()

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())


# The flags that shape a trace's workload (None when not given: trace_workload's own defaults apply), and
# the keyword of trace_workload each one sets.
TRACE_ONLY = {"--trace-start": ("trace_start", "start"), "--trace-hours": ("trace_hours", "hours"),
              "--load": ("load", "load"), "--seed": ("seed", "seed")}


def add_arguments(parser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload",
                     help="workload CSV (name,time,application,num_replicas,batch_size) or a shared name: "
                          "workload-1..workload-6, realistic/workload-1..6 (shipped in "
                          "elasticlab/data/adaptdl; $ELASTICLAB_ADAPTDL_DATA overrides the folder)")
    src.add_argument("--trace",
                     help="a cluster trace turned into a workload by the Pollux artifact's rules: 'philly' "
                          "(82,248 jobs, 109 days) or a CSV of timestamp,duration,num_gpus")
    parser.add_argument("--trace-start", type=float, default=None,
                        help="--trace: window start, hours after its first job (default 0)")
    parser.add_argument("--trace-hours", type=float, default=None,
                        help="--trace: window length in hours (default: to the end of the trace)")
    parser.add_argument("--load", type=float, default=None,
                        help="--trace: load factor, x the jobs (default 1)")
    parser.add_argument("--seed", type=int, default=None,
                        help="--trace: seed of the model/config draws (default 0)")
    parser.add_argument("--policy", required=True, choices=_PolicyNames())
    parser.add_argument("--cluster", default="16x4", help="NODESxGPUS_PER_NODE (default 16x4)")
    parser.add_argument("--interval", type=float, default=60.0, help="scheduling interval, s (default 60)")
    parser.add_argument("--restart-delay", type=float, default=30.0,
                        help="re-allocation delay, s (default 30)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N jobs (N >= 1)")
    parser.add_argument("--out", default=None, help="write the full result (jobs, utilisation) as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check_out(path: str) -> str | None:
    """Why ``--out`` cannot be written (checked before the run), or None."""
    import os

    p = os.path.abspath(path)
    if os.path.isdir(p):
        return f"--out {path!r} is a folder; name the JSON file to write"
    folder = os.path.dirname(p)
    if not os.path.isdir(folder):
        return f"--out {path!r}: the folder {folder!r} does not exist"
    if not os.access(folder, os.W_OK):
        return f"--out {path!r}: the folder {folder!r} is not writable"
    return None


def _check_flags(args) -> str | None:
    """Why a flag is unusable (checked before anything heavy is imported, by the simulator's own checks in
    :mod:`elasticlab.sim.checks` under the flags' names), or None."""
    from elasticlab.sim import checks

    try:
        checks.check_interval(args.interval, "--interval")
        checks.check_restart_delay(args.restart_delay, "--restart-delay")
        checks.check_limit(args.limit, "--limit")
        if args.trace is None:
            given = [f for f, (v, _) in TRACE_ONLY.items() if getattr(args, v) is not None]
            if given:
                return f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only with --trace " \
                       f"(a --workload CSV fixes its own jobs)"
        else:
            if args.trace_start is not None:
                checks.check_hours(args.trace_start, "--trace-start", allow_zero=True)
            if args.trace_hours is not None:
                checks.check_hours(args.trace_hours, "--trace-hours")
            if args.load is not None:
                checks.check_load(args.load, "--load")
            if args.seed is not None:
                checks.check_seed(args.seed, "--seed")
    except ValueError as e:
        return str(e)
    return _check_out(args.out) if args.out else None


def run(args) -> int:
    import json
    import math
    import sys

    why = _check_flags(args)
    if why:
        print(f"elasticlab simulate: error: {why}", file=sys.stderr)
        return 2
    import resource
    import time

    from elasticlab.sim import simulate, trace_workload

    t0 = time.perf_counter()
    try:
        if args.trace is not None:
            given = {kw: getattr(args, v) for v, kw in TRACE_ONLY.values() if getattr(args, v) is not None}
            workload = trace_workload(args.trace, **given)
            label = f"trace {args.trace}"
        else:
            workload, label = args.workload, None
        res = simulate(workload, args.policy, cluster=args.cluster, interval=args.interval,
                       restart_delay=args.restart_delay, limit=args.limit, progress=not args.no_progress)
    except ValueError as e:
        print(f"elasticlab simulate: error: {e}", file=sys.stderr)
        return 2
    if label is not None:
        res.workload = label
    s = res.summary
    s["wall_s"] = time.perf_counter() - t0
    s["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    print(f"policy {res.policy} on {res.workload}, cluster {args.cluster}: {s['completed']}/{s['jobs']} jobs")
    for key in ("avg_jct", "median_jct", "p99_jct", "makespan"):
        print(f"  {key:12s} {s[key]:10.0f} s  ({s[key] / 3600:.2f} h)")
    print(f"  gpu util     {s.get('gpu_utilisation', math.nan):10.3f}")
    print(f"  restarts     {s['restarts']:10d}")
    print(f"  sched/round  {s['sched_ms_per_round']:10.2f} ms over {s['rounds']} rounds")
    print(f"  wall         {s['wall_s']:10.1f} s, peak memory {s['peak_rss_mb']:.0f} MB")
    rc = 0
    if args.out:
        try:
            res.to_json(args.out)
            print(f"  wrote {args.out}")
        except OSError as e:
            print(f"elasticlab simulate: error: could not write --out {args.out!r}: {e}", file=sys.stderr)
            rc = 1
    print("RESULT " + json.dumps({k: v for k, v in s.items()}))
    return rc
