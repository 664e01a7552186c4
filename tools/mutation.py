"""Mutation testing of the core modules, with no third-party tool: does the test suite notice a planted bug?

Each mutant changes one node of a module's syntax tree (an arithmetic or comparison operator swapped, a
boolean operator flipped, a numeric constant nudged, a unary minus dropped), is written over the module in
a *copy* of the repository (``git archive HEAD`` plus the built ``_C``), and the module's tests run against
it with ``-x``: a failing test kills the mutant, a clean pass lets it survive. Survivors are printed with
their line, for a person to judge (equivalent mutants exist: ``x <= 0`` and ``x < 0`` agree on integers that
are never 0, for instance).

    python tools/mutation.py [--target estimator,dp,sampler] [--max 40] [--timeout 120] [--lines 84,87]
                             [--keep DIR]

The unmutated copy's tests run first and must pass (else every mutant would count as killed). Where the
target or a module importing it uses numba, each test run gets a fresh ``NUMBA_CACHE_DIR``: numba's on-disk
cache kept serving a kernel compiled against an earlier version of a module it calls (dp's greedy calls
heap's), even with the caller's file touched, so every heap mutant "survived". Hypothesis runs under a
profile without shrinking (a verdict needs a failure, not the smallest one) and without deadlines (a slow
example on a loaded machine is not a kill).

Last line: ``RESULT {json}`` with per-target counts and the survivors.
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# target: (module file, tests that exercise it)
TARGETS = {
    "estimator": ("elasticlab/gns/estimator.py", ["tests/gns/test_estimator.py"]),
    "dp": ("elasticlab/alloc/dp.py", ["tests/alloc/test_dp.py"]),
    "sampler": ("elasticlab/elastic/sampler.py",
                ["tests/elastic/test_sampler.py", "tests/elastic/test_components.py"]),
    "checkpoint": ("elasticlab/elastic/checkpoint.py",
                   ["tests/elastic/test_checkpoint.py", "tests/elastic/test_components.py"]),
    "hull": ("elasticlab/alloc/hull.py", ["tests/alloc/test_dp_nonconcave.py", "tests/alloc/test_dp.py"]),
    "heap": ("elasticlab/alloc/heap.py", ["tests/alloc/test_dp.py", "tests/alloc/test_dp_nonconcave.py"]),
    "efficiency": ("elasticlab/goodput/efficiency.py", ["tests/goodput/test_pollux_model.py"]),
    "goodput": ("elasticlab/goodput/function.py",
                ["tests/goodput/test_pollux_model.py", "tests/goodput/test_agent.py"]),
}

_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
         ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.And: ast.Or, ast.Or: ast.And, ast.Pow: ast.Mult}


def _sites(tree: ast.AST):
    """(node index in ast.walk order, what, line) for every mutable node; docstrings are skipped."""
    for i, node in enumerate(ast.walk(tree)):
        if isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in _SWAP:
            yield i, f"{type(node.op).__name__} -> {_SWAP[type(node.op)].__name__}", node.lineno
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _SWAP:
            yield i, f"{type(node.ops[0]).__name__} -> {_SWAP[type(node.ops[0])].__name__}", node.lineno
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            yield i, "drop unary minus", node.lineno
        elif (isinstance(node, ast.Constant) and type(node.value) in (int, float)
              and not isinstance(node.value, bool)):
            yield i, f"constant {node.value!r} -> {_nudge(node.value)!r}", node.lineno


def _nudge(v):
    return v + 1 if isinstance(v, int) else (v * 1.5 if v else 1.0)


def mutate(tree: ast.AST, index: int) -> ast.AST:
    """A copy of ``tree`` with node ``index`` (ast.walk order) mutated."""
    tree = copy.deepcopy(tree)
    for i, node in enumerate(ast.walk(tree)):
        if i != index:
            continue
        if isinstance(node, (ast.BinOp, ast.BoolOp)):
            node.op = _SWAP[type(node.op)]()
        elif isinstance(node, ast.Compare):
            node.ops = [_SWAP[type(node.ops[0])]()]
        elif isinstance(node, ast.UnaryOp):
            node.op = ast.UAdd()
        elif isinstance(node, ast.Constant):
            node.value = _nudge(node.value)
        return tree
    raise IndexError(index)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _importers(work: Path, rel: str) -> list[Path]:
    """Modules of the copy that import the module at ``rel``."""
    dotted = rel[:-3].replace("/", ".")
    return [p for p in (work / "elasticlab").rglob("*.py") if p != work / rel and dotted in p.read_text()]


_PROFILE = """from hypothesis import Phase, settings

settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], deadline=None)
"""


def _pytest(work: Path, tests: list[str], timeout: int, fresh_jit: bool):
    with tempfile.TemporaryDirectory(prefix="numba-", dir=work) as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache} if fresh_jit else None
        try:
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                   "-p", "_mutation_profile", "--hypothesis-profile=mutation", *tests]
            return subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout,
                                  env=env).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def run_target(name: str, work: Path, max_mutants: int, timeout: int, lines=None) -> dict:
    rel, tests = TARGETS[name]
    path = work / rel
    original = path.read_text()
    fresh_jit = any("numba" in p.read_text() for p in [path, *_importers(work, rel)])
    if _pytest(work, tests, timeout, fresh_jit) != 0:
        raise SystemExit(f"{name}: the tests {tests} fail on the unmutated copy; no mutant verdict possible")
    tree = ast.parse(original)
    skip = _docstring_lines(tree)
    sites = [s for s in _sites(tree) if s[2] not in skip]
    step = max(1, len(sites) // max_mutants) if max_mutants else 1
    chosen = sites[::step][:max_mutants] if max_mutants else sites
    if lines:                                    # a rerun of the survivors: the same selection, fewer lines
        chosen = [c for c in chosen if c[2] in lines]
    killed, survived, errors = 0, [], 0
    try:
        for idx, what, line in chosen:
            path.write_text(ast.unparse(mutate(tree, idx)))
            status = _pytest(work, tests, timeout, fresh_jit)  # "timeout": a hanging mutant counts as killed
            if status == 0:
                survived.append({"line": line, "mutation": what,
                                 "source": original.splitlines()[line - 1].strip()})
            elif status in (1, "timeout"):
                killed += 1
            else:
                errors += 1                          # collection or usage error: not a verdict
            print(f"  {name}:{line:<4d} {what:32s} {'SURVIVED' if status == 0 else 'killed'}", flush=True)
    finally:
        path.write_text(original)
    return {"module": rel, "sites": len(sites), "mutants": len(chosen), "killed": killed,
            "survived": survived, "errors": errors}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=",".join(TARGETS))
    ap.add_argument("--max", type=int, default=40, help="mutants per target, spread over the file (0: all)")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per mutant's test run")
    ap.add_argument("--lines", default="", help="only the selected mutants on these lines, e.g. 84,87")
    ap.add_argument("--keep", help="use (and keep) this directory for the copy instead of a temporary one")
    args = ap.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="elasticlab-mutation-"))
    try:
        if not (work / "elasticlab").is_dir():
            work.mkdir(parents=True, exist_ok=True)
            tar = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(work)], input=tar, check=True)
            for so in (ROOT / "elasticlab").glob("_C*.so"):
                shutil.copy2(so, work / "elasticlab" / so.name)
        (work / "_mutation_profile.py").write_text(_PROFILE)
        result = {}
        for name in [t for t in args.target.split(",") if t]:
            if name not in TARGETS:
                raise SystemExit(f"unknown target {name!r}; expected one of {sorted(TARGETS)}")
            print(f"{name}: {TARGETS[name][0]}", flush=True)
            result[name] = run_target(name, work, args.max, args.timeout,
                                      {int(x) for x in args.lines.split(",") if x})
            r = result[name]
            print(f"{name}: {r['mutants']} mutants of {r['sites']} sites, {r['killed']} killed, "
                  f"{len(r['survived'])} survived, {r['errors']} errors", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
