"""The registry of paper reproductions: one :class:`Reproduction` per claim of ``papers.md``.

A reproduction is a function ``run(quick) -> Outcome`` (measured numbers, pass/fail against the target,
a plotly figure) plus its id, paper, claim and target in words. Claim modules register theirs with the
:func:`reproduction` decorator; :func:`load` imports them (lazily, so the CLI stays fast). The functions
call the experiments of the other packages (``elasticlab.gns.experiments``, ``elasticlab.lr.experiments``,
``elasticlab.dynamics.experiments``, ...), never re-implement them.
"""

from __future__ import annotations

import importlib
import math
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Outcome",
    "Reproduction",
    "Result",
    "PAPERS",
    "CLAIM_MODULES",
    "REGISTRY",
    "reproduction",
    "register",
    "load",
    "all_reproductions",
    "get",
    "select",
    "run_one",
    "run_all",
    "to_jsonable",
    "STATUSES",
    "status_of",
]

#: The three verdicts a run of a claim can have: passed as the target is written; passed only under a
#: reading of the target or a setup that differs from papers.md or was chosen after seeing results (the
#: claim's ``reread`` says how); not passed.
STATUSES = {
    "reproduced": "reproduced",
    "reread": "reproduced only as re-read",
    "not_reproduced": "not reproduced",
}


def status_of(passed: bool, reread: str | None) -> str:
    """A key of :data:`STATUSES`."""
    if not passed:
        return "not_reproduced"
    return "reread" if reread else "reproduced"

#: Short citations of the papers, keyed by the prefix of a claim id.
PAPERS = {
    "P1": "Saxena et al., Effective Elastic Scaling of DL Workloads (MASCOTS 2020)",
    "P2": "Lin et al., Dynamic Mini-batch SGD for Elastic Distributed Training (arXiv 2019)",
    "P3": "Basu et al., Layer Dynamics of Linearised Neural Nets (arXiv 2019); Saxe et al. 2014; "
    "Du et al. 2018",
    "P4": "Qiao et al., Pollux: Co-adaptive Cluster Scheduling (OSDI 2021)",
    "P5": "McCandlish et al., An Empirical Model of Large-Batch Training (2018); Gray et al. 2024",
    "P6": "Johnson et al., AdaScale SGD (ICML 2020)",
    "PSG": "Gray et al. 2024 / psgnorm-anchors: per-example gradient norms at low overhead",
    "SIM": "Pollux OSDI'21 artifact simulator (petuum/adaptdl, osdi21-artifact), workload-6",
}

#: Targets of papers.md that no experiment measures yet, with the reason (shown by the report and --list).
NOT_REPRODUCED = {
}

#: Modules that register claims, one per paper; imported by :func:`load`.
CLAIM_MODULES = (
    "elasticlab.repro.p1_saxena",
    "elasticlab.repro.p2_dynamic_sgd",
    "elasticlab.repro.p3_layer_dynamics",
    "elasticlab.repro.p4_pollux",
    "elasticlab.repro.p5_gns",
    "elasticlab.repro.p5_guided_batch",
    "elasticlab.repro.p6_adascale",
    "elasticlab.repro.psgnorm",
    "elasticlab.repro.sim_fidelity",
)


@dataclass(frozen=True)
class Outcome:
    """What one run of a reproduction measured: ``measured`` (JSON-friendly numbers), ``passed`` against
    the target, a one-line ``summary`` for tables and an optional plotly ``figure``."""

    measured: Any
    passed: bool
    summary: str = ""
    figure: Any = None


@dataclass(frozen=True)
class Reproduction:
    """One claim: ``id`` (e.g. ``"P5-T1"``), ``paper``, ``claim`` and ``target`` in words, and ``fn``,
    called as ``fn(quick)`` and returning an :class:`Outcome`.

    ``slow``: no quick version exists (e.g. a whole simulated workload): quick runs leave it out unless it
    is named explicitly. ``timed``: the verdict depends on wall-clock timings, so it is only as good as
    the machine is quiet (the test suite checks that it runs, the report shows the verdict).
    ``reread``: why a pass of this claim is only a pass as re-read -- the criterion it checks is a reading
    of the written target, or its setup differs from papers.md or was chosen after seeing results; the
    report then says "reproduced only as re-read" with this reason, never plain "reproduced".
    ``gap``: why the claim, judged as written, is known not to reproduce here (and whether the target itself
    is in doubt); shown next to a "not reproduced" verdict, never used to change it."""

    id: str
    paper: str
    claim: str
    target: str
    fn: Callable[[bool], Outcome]
    needs: tuple[str, ...] = ()
    slow: bool = False
    timed: bool = False
    reread: str | None = None
    gap: str | None = None

    def run(self, quick: bool = False) -> Outcome:
        out = self.fn(bool(quick))
        if not isinstance(out, Outcome):
            raise TypeError(f"reproduction {self.id} returned {type(out).__name__}, expected an Outcome")
        return out


@dataclass
class Result:
    """A reproduction's run, ready for the report: the claim, what was measured, pass/fail, seconds."""

    id: str
    paper: str
    claim: str
    target: str
    measured: Any
    passed: bool
    seconds: float
    summary: str = ""
    quick: bool = False
    error: str | None = None
    figure: Any = field(default=None, repr=False)
    timed: bool = False
    reread: str | None = None
    gap: str | None = None

    @property
    def status(self) -> str:
        """``reproduced``, ``reread`` or ``not_reproduced`` (:data:`STATUSES`)."""
        return status_of(self.passed, self.reread)

    def to_json(self) -> dict:
        """The JSON record of ``results.json`` (the figure is left out; it lives in ``report.html``)."""
        return {
            "id": self.id,
            "paper": self.paper,
            "claim": self.claim,
            "target": self.target,
            "measured": to_jsonable(self.measured),
            "passed": bool(self.passed),
            "status": self.status,
            "reread": self.reread,
            "gap": self.gap if self.status == "not_reproduced" else None,
            "summary": self.summary,
            "seconds": round(float(self.seconds), 3),
            "quick": self.quick,
            "timed": self.timed,
            "error": self.error,
        }


REGISTRY: dict[str, Reproduction] = {}
_ID = re.compile(r"^[A-Z][A-Z0-9]*-[A-Za-z0-9.]+$")


def register(rep: Reproduction) -> Reproduction:
    """Add ``rep`` to :data:`REGISTRY`; an id that is malformed or already taken is a ValueError."""
    if not _ID.match(rep.id):
        raise ValueError(f"reproduction id must look like 'P5-T1', got {rep.id!r}")
    old = REGISTRY.get(rep.id)
    if (
        old is not None
        and old.fn is not rep.fn
        and getattr(old.fn, "__qualname__", None) != getattr(rep.fn, "__qualname__", None)
    ):
        raise ValueError(f"reproduction id {rep.id!r} is already registered by {old.fn!r}")
    REGISTRY[rep.id] = rep
    return rep


def reproduction(
    id: str,
    claim: str,
    target: str,
    paper: str | None = None,
    needs: tuple[str, ...] = (),
    slow: bool = False,
    timed: bool = False,
    reread: str | None = None,
    gap: str | None = None,
):
    """Decorator registering ``fn(quick) -> Outcome`` as the reproduction of one claim.

    ``paper`` defaults to the citation of the id's prefix in :data:`PAPERS`; ``needs`` names the
    modules the experiment imports (listed by ``elasticlab reproduce --list``); ``slow``, ``timed``,
    ``reread`` and ``gap``: see :class:`Reproduction`."""

    def wrap(fn):
        prefix = id.split("-", 1)[0]
        register(
            Reproduction(
                id=id,
                paper=paper or PAPERS.get(prefix, prefix),
                claim=claim,
                target=target,
                fn=fn,
                needs=tuple(needs),
                slow=slow,
                timed=timed,
                reread=reread,
                gap=gap,
            )
        )
        return fn

    return wrap


_loaded: dict[str, str | None] = {}


def load(modules=CLAIM_MODULES) -> dict[str, str | None]:
    """Import the claim modules (once); returns ``{module: None or the import error}``. A module whose
    experiments are not importable yet registers nothing and is reported here, not raised."""
    for name in modules:
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
            _loaded[name] = None
        except Exception as e:  # noqa: BLE001 - reported by load() and `reproduce --list`
            _loaded[name] = f"{type(e).__name__}: {e}"
    return {m: _loaded[m] for m in modules}


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def all_reproductions() -> list[Reproduction]:
    """Every registered reproduction (after :func:`load`), in natural id order (P1-T1, ..., SIM-...)."""
    load()
    return [REGISTRY[k] for k in sorted(REGISTRY, key=_natural)]


def get(id: str) -> Reproduction:
    load()
    try:
        return REGISTRY[id]
    except KeyError:
        known = ", ".join(sorted(REGISTRY, key=_natural))
        raise KeyError(f"no reproduction {id!r}; known: {known}") from None


def select(only=None, quick: bool = False) -> list[Reproduction]:
    """The reproductions named by ``only``: ids (``"P5-T1"``) or prefixes (``"P5"`` = every P5 claim),
    case-insensitive; ``None``/empty = all. A name that matches nothing is a ValueError naming it.
    ``quick``: leave out the slow claims, except those named by their full id."""
    reps = all_reproductions()
    if not only:
        return [r for r in reps if not (quick and r.slow)]
    if isinstance(only, str):
        only = [only]
    names = [n.strip() for item in only for n in str(item).split(",") if n.strip()]
    if not names:
        raise ValueError(f"--only names no claim (got {only!r}); give ids (P5-T1) or prefixes (P5)")
    chosen: list[Reproduction] = []
    for name in names:
        up = name.upper()
        hits = [r for r in reps if r.id.upper() == up or r.id.upper().startswith(up.rstrip("-") + "-")]
        if not hits:
            raise ValueError(f"no reproduction matches {name!r}; known ids: {', '.join(r.id for r in reps)}")
        if quick and len(hits) > 1:
            hits = [r for r in hits if not r.slow]
        chosen += [r for r in hits if r not in chosen]
    return sorted(chosen, key=lambda r: _natural(r.id))


def run_one(rep: Reproduction, quick: bool = False) -> Result:
    """Run one reproduction, timed. An exception becomes a failed :class:`Result` carrying the error
    (the last lines of its traceback), so one broken claim never stops a report."""
    t0 = time.perf_counter()
    try:
        out = rep.run(quick)
        err = None
    except Exception as e:  # noqa: BLE001 - a report must survive a broken experiment
        tb = traceback.format_exc().strip().splitlines()
        out = Outcome(measured=None, passed=False, summary=f"error: {type(e).__name__}: {e}")
        err = "\n".join(tb[-6:])
    return Result(
        id=rep.id,
        paper=rep.paper,
        claim=rep.claim,
        target=rep.target,
        measured=to_jsonable(out.measured),
        passed=bool(out.passed),
        seconds=time.perf_counter() - t0,
        summary=out.summary,
        quick=bool(quick),
        error=err,
        figure=out.figure,
        timed=rep.timed,
        reread=rep.reread,
        gap=rep.gap,
    )


def run_all(reps=None, quick: bool = False, progress: bool = True, callback=None) -> list[Result]:
    """Run ``reps`` (default: all) in order with a tqdm progress bar; ``callback(result)`` after each."""
    reps = all_reproductions() if reps is None else list(reps)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(reps), desc="reproduce", unit="claim")
    results = []
    try:
        for rep in reps:
            if bar is not None:
                bar.set_postfix_str(rep.id)
            res = run_one(rep, quick)
            results.append(res)
            if callback is not None:
                callback(res)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return results


def to_jsonable(x):
    """Numbers, arrays, tuples-as-keys, numpy/torch scalars -> plain JSON types (NaN/inf -> strings)."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {(k if isinstance(k, str) else _key(k)): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [to_jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy / torch arrays and scalars
        return to_jsonable(x.tolist())
    if hasattr(x, "item"):
        return to_jsonable(x.item())
    return str(x)


def _key(k) -> str:
    if isinstance(k, tuple):
        return "x".join(str(v) for v in k)
    return str(k)
