"""Workloads: the Pollux artifact's CSVs (name, time, application, num_replicas, batch_size)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from elasticlab.sim.traces import APPLICATIONS, data_dir

__all__ = ["load_workload", "workload_path", "workload_names", "WORKLOAD_COLUMNS"]

WORKLOAD_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


def workload_names() -> list[str]:
    """The shared workloads by name, 'workload-1'.. and 'realistic/workload-1'.. (in :func:`data_dir`)."""
    root = data_dir()

    def key(p):
        tail = p.stem.rsplit("-", 1)[-1]
        return (int(tail) if tail.isdigit() else 10**9, p.stem)

    out = [p.stem for p in sorted((root / "workloads").glob("*.csv"), key=key)]
    out += [f"realistic/{p.stem}" for p in sorted((root / "workloads-realistic").glob("*.csv"), key=key)]
    return out


def workload_path(spec) -> Path:
    """A CSV path, or a shared workload by name: 'workload-6' / '6' / 'realistic/workload-6'."""
    p = Path(str(spec))
    if p.suffix == ".csv" and p.is_file():
        return p
    s = str(spec)
    sub = "workloads"
    if s.startswith("realistic/"):
        sub, s = "workloads-realistic", s.split("/", 1)[1]
    if s.isdigit():
        s = f"workload-{s}"
    cand = data_dir() / sub / f"{s.removesuffix('.csv')}.csv"
    if cand.is_file():
        return cand
    what = f"no CSV file {str(spec)!r}" if p.suffix == ".csv" else "not a CSV file"
    raise ValueError(f"workload {spec!r} not found ({what}, and no shared workload of that name in "
                     f"{data_dir()}); shared workloads: {', '.join(workload_names())}")


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
