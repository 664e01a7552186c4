"""Paper reproductions: one registered claim per target of ``shared/reference/papers.md``, each measured
by calling the experiments of the other packages, and a report (``report.html`` + ``results.json``).

>>> from elasticlab import repro
>>> results = repro.run_all(repro.select(["P5"]), quick=True)
>>> repro.write_report(results, "out/")

``elasticlab reproduce [--quick] [--only ID] --out DIR`` does the same from a terminal.
"""

from .registry import (
    PAPERS,
    REGISTRY,
    Outcome,
    Reproduction,
    Result,
    all_reproductions,
    get,
    load,
    register,
    reproduction,
    run_all,
    run_one,
    select,
)
from .report import load_results, summary_table, write_report

__all__ = [
    "PAPERS",
    "REGISTRY",
    "Outcome",
    "Reproduction",
    "Result",
    "all_reproductions",
    "get",
    "load",
    "register",
    "reproduction",
    "run_all",
    "run_one",
    "select",
    "write_report",
    "summary_table",
    "load_results",
]
