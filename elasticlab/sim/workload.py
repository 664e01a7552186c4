"""Workloads: the Pollux artifact's CSVs (name, time, application, num_replicas, batch_size)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from elasticlab.sim.traces import APPLICATIONS, data_dir

__all__ = ["load_workload", "workload_path", "WORKLOAD_COLUMNS"]

WORKLOAD_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


def workload_path(spec) -> Path:
    """A CSV path, or a shared workload by name: 'workload-6' / '6' / 'realistic/workload-6'."""
    p = Path(str(spec))
    if p.suffix == ".csv" and p.exists():
        return p
    s = str(spec)
    sub = "workloads"
    if s.startswith("realistic/"):
        sub, s = "workloads-realistic", s.split("/", 1)[1]
    if s.isdigit():
        s = f"workload-{s}"
    cand = data_dir() / sub / f"{s.removesuffix('.csv')}.csv"
    if cand.exists():
        return cand
    raise ValueError(f"workload {spec!r} not found (neither a CSV file nor {cand})")


def load_workload(spec, limit: int | None = None) -> pd.DataFrame:
    """Read and check a workload; ``limit`` keeps the first jobs by submission time (for quick runs)."""
    path = workload_path(spec)
    df = pd.read_csv(path)
    missing = [c for c in WORKLOAD_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"workload {path} lacks columns {missing}; needs {list(WORKLOAD_COLUMNS)}")
    bad = df[~df.application.isin(APPLICATIONS)]
    if len(bad):
        raise ValueError(f"workload {path}: unknown application {bad.application.iloc[0]!r} "
                         f"(known: {APPLICATIONS})")
    if (df.time < 0).any() or (df.num_replicas < 1).any() or (df.batch_size < 1).any():
        raise ValueError(f"workload {path}: time must be >= 0, num_replicas and batch_size >= 1")
    if df.name.duplicated().any():
        raise ValueError(f"workload {path}: duplicate job name {df.name[df.name.duplicated()].iloc[0]!r}")
    df = df.sort_values(["time", "name"]).reset_index(drop=True)
    if limit is not None:
        df = df.head(int(limit)).reset_index(drop=True)
    return df
