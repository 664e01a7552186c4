"""``elasticlab simulate``: replay a workload on a simulated cluster under one scheduling policy."""
from __future__ import annotations

NAME = "simulate"
HELP = "replay a Pollux-artifact workload (CSV) on a simulated GPU cluster under a scheduling policy"


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


def add_arguments(parser) -> None:
    parser.add_argument("--workload", required=True,
                        help="workload CSV (name,time,application,num_replicas,batch_size) or a shared name: "
                             "workload-1..workload-6, realistic/workload-1..6 (shipped in "
                             "elasticlab/data/adaptdl; $ELASTICLAB_ADAPTDL_DATA overrides the folder)")
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
    """Why a numeric flag is unusable (checked before anything heavy is imported), or None."""
    import math

    if not (math.isfinite(args.interval) and args.interval > 0):
        return f"--interval must be a finite number of seconds > 0, got {args.interval!r}"
    if not (math.isfinite(args.restart_delay) and args.restart_delay >= 0):
        return f"--restart-delay must be a finite number of seconds >= 0, got {args.restart_delay!r}"
    if args.limit is not None and args.limit < 1:
        return f"--limit must be a whole number of jobs >= 1, got {args.limit!r}"
    return _check_out(args.out) if args.out else None


def run(args) -> int:
    import json
    import math
    import sys

    why = _check_flags(args)
    if why:
        print(f"elasticlab simulate: error: {why}", file=sys.stderr)
        return 2
    from elasticlab.sim import simulate

    try:
        res = simulate(args.workload, args.policy, cluster=args.cluster, interval=args.interval,
                       restart_delay=args.restart_delay, limit=args.limit, progress=not args.no_progress)
    except ValueError as e:
        print(f"elasticlab simulate: error: {e}", file=sys.stderr)
        return 2
    s = res.summary
    print(f"policy {res.policy} on {res.workload}, cluster {args.cluster}: {s['completed']}/{s['jobs']} jobs")
    for key in ("avg_jct", "median_jct", "p99_jct", "makespan"):
        print(f"  {key:12s} {s[key]:10.0f} s  ({s[key] / 3600:.2f} h)")
    print(f"  gpu util     {s.get('gpu_utilisation', math.nan):10.3f}")
    print(f"  restarts     {s['restarts']:10d}")
    print(f"  sched/round  {s['sched_ms_per_round']:10.2f} ms over {s['rounds']} rounds")
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
