"""Workloads: the Pollux artifact's CSVs (name, time, application, num_replicas, batch_size)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from elasticlab.sim.checks import check_limit
from elasticlab.sim.traces import APPLICATIONS, data_dir

__all__ = ["load_workload", "workload_path", "workload_names", "check_workload", "check_limit",
           "WORKLOAD_COLUMNS"]

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


def check_workload(df: pd.DataFrame, source: str = "workload", first_line: int | None = None) -> pd.DataFrame:
    """``df`` with numeric ``time`` / ``num_replicas`` / ``batch_size`` columns when every row is a valid job;
    otherwise a ValueError naming the job, its line (``first_line``: the file line of row 0) and the value.

    Every job needs a name, a finite submission time >= 0 (s), a known application and whole numbers >= 1
    of replicas and batch."""
    missing = [c for c in WORKLOAD_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{source} lacks columns {missing}; needs {list(WORKLOAD_COLUMNS)}")
    if not len(df):
        raise ValueError(f"{source} has no jobs (a header and no rows); needs one row per job with "
                         f"{', '.join(WORKLOAD_COLUMNS)}")
    df = df.reset_index(drop=True)

    def where(i):
        line = f", line {first_line + i}" if first_line is not None else f", row {i}"
        return f"{source}: job {df['name'].iloc[i]!r}{line}"

    def show(v):
        if isinstance(v, np.generic):
            v = v.item()
        return "an empty value" if v is None or (isinstance(v, float) and math.isnan(v)) else repr(v)

    names = df["name"]
    empty = names.isna() | (names.astype(str).str.strip() == "")
    if empty.any():
        i = int(np.flatnonzero(empty.to_numpy())[0])
        raise ValueError(f"{where(i)} has no name")
    out = df.copy()
    for col, whole in (("time", False), ("num_replicas", True), ("batch_size", True)):
        raw = df[col]
        num = pd.to_numeric(raw, errors="coerce").astype(float)
        if whole:
            bad = ~np.isfinite(num) | (num < 1) | (num != np.round(num))
            need = "a whole number >= 1"
        else:
            bad = ~np.isfinite(num) | (num < 0)
            need = "a finite number of seconds >= 0"
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise ValueError(f"{where(i)} has {col} {show(raw.iloc[i])}; it must be {need}")
        if not (pd.api.types.is_integer_dtype(raw) or (not whole and pd.api.types.is_float_dtype(raw))):
            out[col] = num.astype(np.int64) if whole else num  # as read when already numeric
    bad = ~out.application.isin(APPLICATIONS)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise ValueError(f"{where(i)}: unknown application {show(df.application.iloc[i])} "
                         f"(known: {APPLICATIONS})")
    if out.name.duplicated().any():
        raise ValueError(f"{source}: duplicate job name {out.name[out.name.duplicated()].iloc[0]!r}")
    return out


def load_workload(spec, limit: int | None = None) -> pd.DataFrame:
    """Read and check a workload; ``limit`` keeps the first jobs by submission time (for quick runs)."""
    limit = check_limit(limit)
    path = workload_path(spec)
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ValueError(f"workload {path} is not a readable CSV: {e}") from None
    df = check_workload(df, f"workload {path}", first_line=2)
    df = df.sort_values(["time", "name"]).reset_index(drop=True)
    if limit is not None:
        df = df.head(limit).reset_index(drop=True)
    return df
