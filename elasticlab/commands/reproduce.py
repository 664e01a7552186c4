"""``elasticlab reproduce``: run the paper reproductions and write report.html + results.json."""

from __future__ import annotations

import sys

NAME = "reproduce"
HELP = "run the paper reproductions (one per claim) and write report.html and results.json"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="the quick versions (what `pytest -m repro` runs)"
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="ID",
        help="claim id (P5-T1) or prefix (P5); repeat or comma-separate for several",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="folder for report.html and results.json (required to run)"
    )
    parser.add_argument("--list", action="store_true", help="list the registered claims and exit")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when a claim fails (default: 0, failures are printed)",
    )


def _unwritable(out) -> str | None:
    """Why the report folder ``out`` (a Path) cannot take the report, or None; it is made if missing."""
    import os

    if out.exists() and not out.is_dir():
        return "is a file; name a folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:                     # a file on the way, no permission, a read-only file system
        return f"cannot be made: {e.strerror or e}"
    if not os.access(out, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def run(args) -> int:
    import json
    import textwrap

    from elasticlab import repro
    from elasticlab.repro.registry import load

    if args.list:
        problems = {m: e for m, e in load().items() if e}
        for r in repro.all_reproductions():
            flags = "".join((" [slow]" if r.slow else "", " [timed]" if r.timed else "",
                             " [re-read]" if r.reread else ""))
            print("\n".join(textwrap.wrap(r.claim + flags, 100, initial_indent=f"{r.id:8s} ",
                                           subsequent_indent=" " * 9)))
        for k, why in repro.registry.NOT_REPRODUCED.items():
            print(f"{k:8s} (not reproduced yet) {why}")
        for m, e in problems.items():
            print(f"(not loaded: {m}: {e})")
        return 0
    if not args.out:
        print("elasticlab reproduce: --out DIR is required (or --list)", file=sys.stderr)
        return 2
    from pathlib import Path

    why = _unwritable(Path(args.out))
    if why:              # before the run, which takes minutes: its results would have nowhere to go
        print(f"elasticlab reproduce: --out {args.out!r} {why}", file=sys.stderr)
        return 2
    try:
        reps = repro.select(args.only, quick=args.quick)
    except ValueError as e:
        print(f"elasticlab reproduce: {e}", file=sys.stderr)
        return 2
    if not reps:
        print(
            "elasticlab reproduce: nothing to run: the claims named are slow and have no quick version; "
            "run without --quick or name them by their full id",
            file=sys.stderr,
        )
        return 2
    mode = "quick" if args.quick else "full"
    print(f"running {len(reps)} reproductions ({mode}) -> {args.out}", flush=True)
    left = [r for r in repro.select(args.only) if r not in reps] if args.quick else []
    if left:
        print(f"left out of the quick run (slow, no quick version): {', '.join(r.id for r in left)}",
              flush=True)
    results = repro.run_all(reps, quick=args.quick, progress=True)
    paths = repro.write_report(results, args.out, quick=args.quick, skipped=left)
    print(repro.summary_table(results, skipped=left))
    failed = [r for r in results if not r.passed]
    for r in failed:
        why = r.error.splitlines()[-1] if r.error else r.summary
        print(f"FAILED {r.id}: {why}\n       target: {r.target}")
    print(f"report: {paths['html']}\nresults: {paths['json']}")
    by = {s: [r.id for r in results if r.status == s] for s in ("reproduced", "reread", "not_reproduced")}
    print("RESULT " + json.dumps({
        "mode": mode, "claims": len(results), "reproduced": len(by["reproduced"]),
        "reread": by["reread"], "not_reproduced": by["not_reproduced"], "skipped": [r.id for r in left],
        "errors": [r.id for r in results if r.error], "seconds": round(sum(r.seconds for r in results), 2),
        "report": str(paths["html"]), "results": str(paths["json"]),
    }), flush=True)
    return 1 if (failed and args.strict) else 0
