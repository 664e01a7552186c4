"""The package, its compiled extension and the CLI."""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from elasticlab import _ext
from elasticlab.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_extension_is_built_and_registers_cpu_kernels():
    assert _ext.HAS_C, "elasticlab._C failed to import: run `make build`"
    assert "row_sq_norms" in _ext.operators()
    assert _ext.has_kernel("row_sq_norms", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_sq_norms_matches_torch(dtype):
    x = torch.randn(5, 3, 4, dtype=dtype)
    got = torch.ops.elasticlab.row_sq_norms(x)
    torch.testing.assert_close(got, x.pow(2).sum((1, 2)))


def test_operator_rejects_integer_input_with_clear_error():
    with pytest.raises(RuntimeError, match="expected a floating tensor"):
        torch.ops.elasticlab.row_sq_norms(torch.ones(3, 2, dtype=torch.int64))


@pytest.mark.gpu
def test_row_sq_norms_cuda_matches_cpu():
    assert _ext.has_kernel("row_sq_norms", "cuda")
    x = torch.randn(64, 1000, dtype=torch.float64)
    torch.testing.assert_close(torch.ops.elasticlab.row_sq_norms(x.cuda()).cpu(),
                               torch.ops.elasticlab.row_sq_norms(x))


def test_missing_extension_warns_once(monkeypatch):
    monkeypatch.setattr(_ext, "HAS_C", False)
    monkeypatch.setattr(_ext, "_warned", False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert _ext.kernel("row_sq_norms", "cpu") is None
        assert _ext.kernel("row_sq_norms", "cpu") is None
    assert len([w for w in rec if "reference path" in str(w.message)]) == 1


def test_info_command(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "extension_built        True" in out
    assert "row_sq_norms" in out


def test_console_script_equals_module():
    out = subprocess.run([sys.executable, "-m", "elasticlab", "info"], capture_output=True, text=True,
                         check=True)
    assert "torch" in out.stdout


def test_ruff_clean():
    """The tree passes the ruff settings of pyproject.toml (ruff comes with the test extra)."""
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed")
    out = subprocess.run([ruff, "check", "--quiet", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ---- the package's shape (issue 15): rooms, floors, registries ---------------------------------------
import ast  # noqa: E402

PKG = ROOT / "elasticlab"
#: The most lines a module of the package may have.
MAX_LINES = 400
#: Each top-level package or module of elasticlab on its floor: an import (at module level or inside a
#: function) goes only to a lower floor. A new package must be placed here.
FLOORS = {"_ext": 0, "checks": 0, "plotting": 0, "dynamics": 0,
          "gns": 1, "goodput": 1,
          "lr": 2, "alloc": 2,
          "elastic": 3, "sim": 3, "integrations": 3,
          "cluster": 4,
          "widgets": 5, "repro": 5,
          "commands": 6, "__main__": 7, "__init__": 7}


def _modules():
    """``(dotted name, path, tree)`` of every module of the package."""
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 2:
            parts = parts[:-1]
        yield ".".join(parts), path, ast.parse(path.read_text(), str(path))


def _imports(name: str, path: Path, tree: ast.Module):
    """``(line, module imported, names imported, at module level)`` for each import of an elasticlab
    module in ``tree`` (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([mod] if mod else []))
            if mod.split(".")[0] == "elasticlab":
                yield node.lineno, mod, [a.name for a in node.names], id(node) in top
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "elasticlab":
                    yield node.lineno, a.name, [], id(node) in top


def _room(module: str) -> str:
    """The top-level package (or module) of elasticlab that ``module`` is in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


#: Modules over MAX_LINES whose split is pending, each with who owns it; remove an entry once it is split.
SPLIT_PENDING = {"elasticlab/alloc/dp.py": "581 lines since a15539a (the hull-bound path); the alloc owner"}


def test_no_module_over_400_lines():
    """Issue 15: every room small enough to hold in one's head."""
    long = {str(p.relative_to(ROOT)): n for _, p, _ in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert all((ROOT / p).exists() for p in SPLIT_PENDING), "SPLIT_PENDING names a module that is gone"
    over = {p: n for p, n in long.items() if p not in SPLIT_PENDING}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_packages_import_only_from_lower_floors():
    rooms = {_room(name) for name, _, _ in _modules()} - {"_C"}
    assert rooms <= set(FLOORS), f"place these packages on a floor in FLOORS: {sorted(rooms - set(FLOORS))}"
    up = []
    for name, path, tree in _modules():
        src = _room(name)
        for line, mod, names, _ in _imports(name, path, tree):
            targets = [f"{mod}.{n}" for n in names] if mod == "elasticlab" else [mod]
            for t in targets:
                dst = _room(t)
                if dst != src and dst != "_C" and FLOORS[dst] >= FLOORS[src]:
                    up.append(f"{path.relative_to(ROOT)}:{line}: {src} (floor {FLOORS[src]}) imports {t} "
                              f"(floor {FLOORS[dst]})")
    assert not up, "imports that do not go down a floor:\n" + "\n".join(up)


def test_no_import_circle_between_modules():
    """No two modules import each other, directly or around a circle, at import time."""
    mods = {name: (path, tree) for name, path, tree in _modules()}
    graph = {name: set() for name in mods}
    for name, (path, tree) in mods.items():
        for _, mod, names, top in _imports(name, path, tree):
            if not top:
                continue
            for t in [f"{mod}.{n}" for n in names] + [mod]:
                if t in mods and t != name:
                    graph[name].add(t)
                    break
    # Tarjan's strongly connected components, iteratively
    index, low, on, stack, circles, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    circles.append(sorted(comp))
    assert not circles, f"import circles: {circles}"


def test_no_private_name_imported_from_another_package():
    bad = []
    for name, path, tree in _modules():
        for line, mod, names, _ in _imports(name, path, tree):
            if _room(mod) == _room(name):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")
                       and f"{mod}.{n}" != "elasticlab._ext" and n != "_C"]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{line}: from {mod} import {', '.join(private)}")
    assert not bad, "private names used across packages:\n" + "\n".join(bad)


def _registries() -> dict[str, tuple[str, set[str]]]:
    """Each kind of thing with its registry's home module and the names it holds."""
    from elasticlab.alloc.policies import POLICIES as ALLOC
    from elasticlab.cluster.policies import policy_names as cluster_policies
    from elasticlab.elastic.policies import POLICIES as BATCH
    from elasticlab.elastic.states import OnNoCheckpoint
    from elasticlab.goodput.agent import MODES
    from elasticlab.lr import RULES
    from elasticlab.sim.traces import APPLICATIONS

    return {"LR rules": ("elasticlab/lr/base.py", set(RULES)),
            "LR rules a job can name": ("elasticlab/lr/base.py", {n for n, r in RULES.items() if r.job_rule}),
            "batch policies": ("elasticlab/elastic/policies.py", set(BATCH)),
            "allocation policies": ("elasticlab/alloc/policies/__init__.py", set(ALLOC)),
            "cluster policies": ("elasticlab/cluster/policies.py", set(cluster_policies())),
            "batch modes": ("elasticlab/goodput/agent.py", set(MODES)),
            "policies with no checkpoint left": ("elasticlab/elastic/states.py",
                                                 {p.value for p in OnNoCheckpoint}),
            "Pollux artifact applications": ("elasticlab/sim/traces.py", set(APPLICATIONS))}


def test_each_kind_of_thing_is_listed_only_in_its_registry():
    """No literal list, tuple, set or dict in the package names every member of a registry again (a copy
    that a new rule or policy would have to be added to)."""
    regs = _registries()
    copies = []
    for _, path, tree in _modules():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if not isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)) or not elts:
                continue
            names = {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            for kind, (home, members) in regs.items():
                if rel != home and len(members) > 1 and members <= names:
                    copies.append(f"{rel}:{node.lineno}: every {kind} listed again")
    assert not copies, "\n".join(copies)


def test_commands_and_widgets_compare_states_through_their_enums():
    """The command line and the panels name a job's, a worker's or a live cluster job's state through its
    enum (JobState, WorkerState, LiveState), never as a bare string compared with a ``state``."""
    from elasticlab.cluster.view import LiveState
    from elasticlab.elastic.states import JobState, WorkerState

    states = {s.value for enum in (JobState, WorkerState, LiveState) for s in enum}
    bare = []
    for _, path, tree in _modules():
        rel = path.relative_to(ROOT)
        if rel.parts[1] not in ("commands", "widgets"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            consts = [c for side in (node.left, *node.comparators)
                      for c in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])
                      if isinstance(c, ast.Constant)]
            if any(c.value in states for c in consts) and "state" in ast.unparse(node).lower():
                bare.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not bare, "states compared as bare strings:\n" + "\n".join(bare)


def test_a_new_lr_rule_or_allocation_policy_is_one_registration(monkeypatch):
    """What reads the registries sees a rule or a policy registered in one place (here, in the test)."""
    from elasticlab import lr
    from elasticlab.alloc import policies as alloc_policies
    from elasticlab.cluster import policies as cluster_policies
    from elasticlab.cluster.spec import JobSpec
    from elasticlab.elastic import scaling
    from elasticlab.lr.base import RULES

    spec = JobSpec(entrypoint="pkg.mod:make_task", lr_rule="cube_root_test")
    with pytest.raises(ValueError, match="cube_root_test"):
        spec.validate(4)
    monkeypatch.setitem(RULES, "cube_root_test", None)  # removed again after the test

    @lr.register("cube_root_test", label="cube root (test)", job_rule=True)
    class CubeRoot:
        def multiplier(self, scale):
            return scale ** (1 / 3)

        def gain(self, scale):
            return 1.0

    assert "cube_root_test" in lr.job_rules() and "cube_root_test" in scaling.lr_rules()
    assert lr.get_rule("cube_root_test").multiplier(8.0) == pytest.approx(2.0)
    assert spec.validate(4).lr_rule == "cube_root_test"

    with pytest.raises(ValueError, match="all_to_first_test"):
        cluster_policies.make_policy("all_to_first_test")
    monkeypatch.setitem(alloc_policies.POLICIES, "all_to_first_test", None)

    @alloc_policies.register_policy
    class AllToFirst(alloc_policies.Policy):
        name, batch_mode, live, baseline = "all_to_first_test", "throughput", True, True

        def allocate(self, jobs, now, cluster):
            return {j.name: (cluster.total_gpus if i == 0 else 0) for i, j in enumerate(jobs)}

    assert "all_to_first_test" in alloc_policies.policy_names()
    assert "all_to_first_test" in cluster_policies.policy_names()
    assert cluster_policies.batch_mode("all_to_first_test") == "throughput"
    assert cluster_policies.BATCH_MODE["all_to_first_test"] == "throughput"
    assert isinstance(cluster_policies.make_policy("all_to_first_test"), AllToFirst)
    from elasticlab.widgets import allocation

    assert "all_to_first_test" in allocation.baseline_policies()  # the AllocationExplorer compares it
