"""Whole-trace workloads: a cluster trace (Philly, or any CSV of timestamp, duration, num_gpus) turned into a
simulator workload the way the Pollux artifact builds its workloads (``simulator/workload.py``,
pollux-artifact.md §5.1).

* jobs shorter than 60 s or over 1000 GPU-hours are left out (the artifact's filter);
* a job's model follows its GPU time: < 1 GPU-h cifar10 or ncf (even odds), 1-10 GPU-h deepspeech2 (half of
  them re-labelled bert), 10-100 GPU-h yolov3, more imagenet;
* its user configuration (replicas, batch) is drawn from the model's configurations whose ideal-speedup
  efficiency is 50-80% and whose run is under 12 h (:func:`configurations`, the artifact's
  ``Application.get_configurations(0.5, 0.8)``); where none qualifies, 1 GPU at its fastest batch;
* submission times are the trace's, in seconds from the window's start (the artifact folds the hour of day
  into one 8-h window; a whole-trace workload keeps the real dates).

``load`` scales the number of jobs: below 1 a random subset, above 1 every job ``floor(load)`` times plus a
random subset for the fraction (copies arrive together). Everything is drawn from ``seed`` alone.
"""
from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from elasticlab.sim.checks import check_hours, check_load, check_seed
from elasticlab.sim.traces import data_dir, load_application

__all__ = ["read_trace", "trace_workload", "configurations", "TRACE_COLUMNS", "trace_path"]

#: The columns a generic trace CSV needs: submission timestamp (seconds, or a date-time), run time in
#: seconds, GPUs; ``gpu_time`` (GPU-seconds) is optional and defaults to duration x num_gpus.
TRACE_COLUMNS = ("timestamp", "duration", "num_gpus")

_HOUR = 3600.0


def trace_path(spec) -> Path:
    """'philly' (the Philly trace of the artifact data: traces/philly.csv or .csv.gz) or a CSV path."""
    s = str(spec)
    if s == "philly":
        root = data_dir() / "traces"
        for name in ("philly.csv", "philly.csv.gz"):
            if (root / name).is_file():
                return root / name
        raise ValueError(f"the Philly trace is missing from {root} (philly.csv or philly.csv.gz); set "
                         f"ELASTICLAB_ADAPTDL_DATA to a copy of the artifact's simulator/ folder")
    p = Path(s)
    if not p.is_file():
        raise ValueError(f"trace {s!r} not found: neither 'philly' nor an existing CSV file")
    return p


def read_trace(spec) -> pd.DataFrame:
    """A trace as a DataFrame of ``time`` (s from its first job), ``duration`` (s), ``num_gpus``,
    ``gpu_time`` (GPU-s), sorted by time; a ValueError naming the line and value of the first bad row."""
    if isinstance(spec, pd.DataFrame):
        raw, source = spec.reset_index(drop=True), "trace (DataFrame)"
    else:
        path = trace_path(spec)
        source = f"trace {path}"
        try:
            raw = pd.read_csv(path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as e:
            raise ValueError(f"{source} is not a readable CSV: {e}") from None
    missing = [c for c in TRACE_COLUMNS if c not in raw.columns]
    if missing:
        raise ValueError(f"{source} lacks columns {missing}; a trace needs {list(TRACE_COLUMNS)} "
                         f"(gpu_time optional)")
    if not len(raw):
        raise ValueError(f"{source} has no jobs")
    line0 = 2 if not isinstance(spec, pd.DataFrame) else 0

    def fail(mask, col, need):
        i = int(np.flatnonzero(mask)[0])
        where = f"line {line0 + i}" if line0 else f"row {i}"
        v = raw[col].iloc[i]
        v = v.item() if isinstance(v, np.generic) else v
        raise ValueError(f"{source}, {where}: {col} {v!r}; it must be {need}")

    ts = raw["timestamp"]
    num = pd.to_numeric(ts, errors="coerce")
    if num.notna().any():  # seconds (a value that is no number is the bad one)
        if num.isna().any():
            fail(num.isna().to_numpy(), "timestamp", "a number of seconds like the others")
        t = num.to_numpy(float)
    else:
        with warnings.catch_warnings():  # pandas warns when it parses element by element
            warnings.simplefilter("ignore", UserWarning)
            parsed = pd.to_datetime(ts, errors="coerce")
        if parsed.isna().any():
            fail(parsed.isna().to_numpy(), "timestamp", "seconds or a date-time")
        t = (parsed - parsed.min()).dt.total_seconds().to_numpy(float)
    if not np.all(np.isfinite(t)):
        fail(~np.isfinite(t), "timestamp", "finite")
    dur = pd.to_numeric(raw["duration"], errors="coerce").to_numpy(float)
    bad = ~np.isfinite(dur) | (dur < 0)
    if bad.any():
        fail(bad, "duration", "a finite number of seconds >= 0")
    gpus = pd.to_numeric(raw["num_gpus"], errors="coerce").to_numpy(float)
    bad = ~np.isfinite(gpus) | (gpus < 1) | (gpus != np.round(gpus))
    if bad.any():
        fail(bad, "num_gpus", "a whole number >= 1")
    if "gpu_time" in raw:
        gt = pd.to_numeric(raw["gpu_time"], errors="coerce").to_numpy(float)
        bad = ~np.isfinite(gt) | (gt < 0)
        if bad.any():
            fail(bad, "gpu_time", "a finite number of GPU-seconds >= 0")
    else:
        gt = dur * gpus
    out = pd.DataFrame({"time": t - t.min(), "duration": dur, "num_gpus": gpus.astype(np.int64),
                        "gpu_time": gt})
    return out.sort_values("time", kind="stable").reset_index(drop=True)


@functools.cache
def configurations(application: str, lo_util: float = 0.5, hi_util: float = 0.8) -> tuple:
    """The artifact's ``get_configurations``: (replicas, batch, predicted JCT s) on packed 4-GPU nodes, for
    replicas in 2, 4, .., 48 whose efficiency (1-GPU JCT / JCT / replicas) is in (lo, hi) and JCT < 12 h;
    the batch of each is the validation batch with the shortest run; (1, its best batch) if none qualifies."""
    app = load_application(application)
    ret, base_jct, base_bsz = [], None, None
    for r in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48):
        if r * app.min_local_bsz > app.max_batch_size:
            break
        full, rem = divmod(r, 4)
        placement = (4,) * full + ((rem,) if rem else ())
        best_jct = best_bsz = None
        for i, bsz in enumerate(app.batch_sizes):
            local = math.ceil(bsz / r - 1e-8)
            if local < app.min_local_bsz:
                continue
            accum = math.ceil(local / app.max_local_bsz - 1e-8) - 1
            atomic = math.ceil(local / (accum + 1) - 1e-8)
            step, sync = app.step_time(placement, atomic)
            jct = float(app._iters[i, app.max_epochs - 1]) * (step + accum * (step - sync))
            if best_jct is None or jct < best_jct:
                best_jct, best_bsz = jct, int(bsz)
        if r == 1:
            base_jct, base_bsz = best_jct, best_bsz
        elif best_jct < 12 * _HOUR and lo_util < base_jct / best_jct / r < hi_util:
            ret.append((r, best_bsz, best_jct))
    if not ret:
        ret.append((1, base_bsz, base_jct))
    return tuple(ret)


def trace_workload(trace="philly", start: float = 0.0, hours: float | None = None, load: float = 1.0,
                   seed: int = 0) -> pd.DataFrame:
    """A workload (name, time, application, num_replicas, batch_size) from ``trace`` ('philly', a CSV path or
    a DataFrame) over the window [start, start + hours) hours from its first job (``hours=None``: to its
    end), with ``load`` x its jobs, deterministic given ``seed``."""
    start = check_hours(start, "start", allow_zero=True)
    if hours is not None:
        hours = check_hours(hours, "hours")
    load = check_load(load)
    seed = check_seed(seed)
    tr = read_trace(trace)
    keep = (tr.duration >= 60) & (tr.gpu_time < 1000 * _HOUR)
    t0 = start * _HOUR
    keep &= tr.time >= t0
    if hours is not None:
        keep &= tr.time < t0 + hours * _HOUR
    tr = tr[keep].reset_index(drop=True)
    if not len(tr):
        span = read_trace(trace).time.max() / _HOUR
        raise ValueError(f"no job of the trace (at least 60 s, under 1000 GPU-hours) is submitted in the "
                         f"window "
                         f"start={start:g} h, hours={hours}; the trace spans {span:.1f} h")
    rng = np.random.default_rng(seed)
    n = len(tr)
    whole, frac = divmod(load, 1.0)
    idx = np.tile(np.arange(n), int(whole))
    extra = int(round(frac * n))
    if extra:
        idx = np.concatenate([idx, np.sort(rng.choice(n, size=extra, replace=False))])
    if not len(idx):
        raise ValueError(f"load {load:g} of the {n} jobs in the window leaves no job; raise load or widen "
                         f"the window")
    gt = tr.gpu_time.to_numpy(float)[idx]
    time = tr.time.to_numpy(float)[idx]
    app = np.where(gt < _HOUR, np.where(rng.random(len(idx)) < 0.5, "cifar10", "ncf"),
                   np.where(gt < 10 * _HOUR, np.where(rng.random(len(idx)) < 0.5, "deepspeech2", "bert"),
                            np.where(gt < 100 * _HOUR, "yolov3", "imagenet"))).astype(object)
    reps = np.empty(len(idx), dtype=np.int64)
    bsz = np.empty(len(idx), dtype=np.int64)
    u = rng.random(len(idx))
    for name in np.unique(app):
        conf = np.array([c[:2] for c in configurations(str(name))], dtype=np.int64)
        sel = app == name
        pick = np.minimum((u[sel] * len(conf)).astype(np.int64), len(conf) - 1)
        reps[sel], bsz[sel] = conf[pick, 0], conf[pick, 1]
    order = np.lexsort((np.arange(len(idx)), time))
    df = pd.DataFrame({"time": np.round(time[order] - t0).astype(np.int64), "application": app[order],
                       "num_replicas": reps[order], "batch_size": bsz[order]})
    df.insert(0, "name", [f"{a}-{i}" for i, a in enumerate(df.application)])
    return df
