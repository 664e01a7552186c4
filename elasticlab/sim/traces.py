"""One model (application) of the Pollux artifact's traces: measured step times and GNS versus progress.

Reads ``traces/<model>/`` of the artifact data (placements.csv, scalability.csv, validation-<M>.csv), shipped
in ``elasticlab/data/adaptdl`` (:func:`data_dir`; ``$ELASTICLAB_ADAPTDL_DATA`` overrides it); the artifact's
simulator section, §5, describes them. Everything a simulated job needs:

* :meth:`Application.step_time` -- true (step, sync) seconds of a placement at a per-GPU batch: measured
  placement -> 1-D linear interpolation in the batch; otherwise linear interpolation over
  (nodes, GPUs, per-GPU batch) of the per-shape means plus the scalability rows (artifact §5.2 step 1);
* :meth:`Application.grad_stats` -- true (sqr, var) at a global batch in an epoch, linear in the batch;
* :meth:`Application.progress_at` -- the epoch boundaries in scale-invariant progress (units of M0 steps);
* :meth:`Application.throughput_model` -- Pollux's theta_sys fitted (once) to all of the model's traces.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd


@functools.lru_cache(maxsize=1)
def fit_code_version() -> str:
    """SHA-1 of the source of the modules that define the throughput model and its fit: part of the on-disk
    cache key of :attr:`Application.throughput_model`."""
    import inspect
    import sys

    from elasticlab.goodput import ThroughputModel, fit_throughput_model

    h = hashlib.sha1()
    for obj in (fit_throughput_model, ThroughputModel):
        h.update(inspect.getsource(sys.modules[obj.__module__]).encode())
    return h.hexdigest()


__all__ = ["Application", "load_application", "data_dir", "APPLICATIONS", "canonical_placement",
           "PACKAGED_DATA", "DATA_ENV"]

APPLICATIONS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")

# per-GPU batch range of each model (artifact applications.py, restated in pollux-artifact.md §5.1)
_LOCAL_BSZ = {"bert": (4, 12), "cifar10": (32, 1024), "deepspeech2": (10, 80), "imagenet": (20, 200),
              "ncf": (32, 32768), "yolov3": (4, 8)}


#: The artifact data shipped inside the package (traces, workloads, published results; see its README.md).
PACKAGED_DATA = Path(__file__).resolve().parent.parent / "data" / "adaptdl"

#: Environment variable that points the simulator at another copy of the artifact data.
DATA_ENV = "ELASTICLAB_ADAPTDL_DATA"


def data_dir() -> Path:
    """Folder of the Pollux artifact data: ``$ELASTICLAB_ADAPTDL_DATA`` when set (an override, e.g. a full
    copy of the artifact's ``simulator/`` folder), else the copy shipped in the package
    (:data:`PACKAGED_DATA`, ``elasticlab/data/adaptdl``)."""
    env = os.environ.get(DATA_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise ValueError(f"{DATA_ENV}={env!r} is not a folder; point it at a copy of the Pollux "
                             f"artifact data (traces/, workloads/) or unset it to use the data shipped with "
                             f"elasticlab ({PACKAGED_DATA})")
        return path
    if not (PACKAGED_DATA / "traces").is_dir():
        raise ValueError(f"the Pollux artifact data shipped with elasticlab is missing ({PACKAGED_DATA}); "
                         f"reinstall elasticlab, or set {DATA_ENV} to a copy of the artifact's simulator/ "
                         f"folder")
    return PACKAGED_DATA


def canonical_placement(placement) -> tuple:
    """Non-empty nodes' GPU counts, rotated to the lexicographically smallest rotation (the traces' key)."""
    p = tuple(map(int, filter(None, placement)))  # (int(x) for x in placement if x), without a Python loop
    if not p:
        return ()
    return min(p[i:] + p[:i] for i in range(len(p)))


class Application:
    """Measured behaviour of one model; ``name`` is one of :data:`APPLICATIONS`."""

    def __init__(self, name: str, root: Path | None = None):
        root = Path(root) if root is not None else data_dir()
        tdir = root / "traces" / name
        if not tdir.is_dir():
            raise ValueError(f"unknown application {name!r}: no trace directory {tdir}")
        self.name = name
        self.validation = {}
        for path in tdir.glob("validation-*.csv"):
            self.validation[int(path.stem.split("-")[1])] = pd.read_csv(path)
        self.batch_sizes = np.array(sorted(self.validation), dtype=float)
        self.init_batch_size = int(self.batch_sizes[0])
        self.max_batch_size = int(self.batch_sizes[-1])
        self.min_local_bsz, self.max_local_bsz = _LOCAL_BSZ[name]
        self.max_epochs = min(len(df) for df in self.validation.values())
        tables = [self.validation[int(m)] for m in self.batch_sizes]
        prog = np.array([df.progress.to_numpy()[: self.max_epochs] for df in tables])
        self._boundaries = np.concatenate([[0.0], prog.min(axis=0)])  # progress at the start of epoch e
        self._sqr = np.array([df.grad_sqr.to_numpy()[: self.max_epochs] for df in tables])  # (n_bsz, epochs)
        self._var = np.array([df.grad_var.to_numpy()[: self.max_epochs] for df in tables])
        self._iters = np.array([df.iteration.to_numpy()[: self.max_epochs] for df in tables])
        self._prog = prog
        pl = pd.read_csv(tdir / "placements.csv")
        pl["placement"] = pl.placement.astype(str)
        pl["num_nodes"] = pl.placement.str.len()
        pl["num_replicas"] = pl.placement.apply(lambda s: sum(int(c) for c in s))
        self.placements = pl
        self.scalability = pd.read_csv(tdir / "scalability.csv")
        self._by_placement = {
            canonical_placement(int(c) for c in key): (
                g.local_bsz.to_numpy(float), g.step_time.to_numpy(float), g.sync_time.to_numpy(float))
            for key, g in pl.sort_values("local_bsz").groupby("placement")
        }
        xs, ys = ["num_nodes", "num_replicas", "local_bsz"], ["step_time", "sync_time"]
        means = pl.groupby(xs)[ys].mean().reset_index()
        pts = pd.concat([means[xs + ys], self.scalability[xs + ys]], ignore_index=True)
        self._nd_points = pts[xs].to_numpy(float)
        self._nd_values = pts[ys].to_numpy(float)
        self._nd = None
        self._cache: dict = {}
        self._stats: dict = {}  # (batch, epoch) -> grad_stats

    def __repr__(self):
        return (f"Application({self.name!r}, M0={self.init_batch_size}, max_batch={self.max_batch_size}, "
                f"epochs={self.max_epochs})")

    # ---- progress and gradient statistics
    @property
    def max_progress(self) -> float:
        return float(self._boundaries[self.max_epochs])

    def progress_at(self, epoch: int) -> float:
        """Scale-invariant progress at the start of ``epoch`` (0 <= epoch <= max_epochs)."""
        return float(self._boundaries[min(max(int(epoch), 0), self.max_epochs)])

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        """True (sqr, var) at global batch ``batch_size`` during ``epoch``, linear in the batch."""
        e = min(max(int(epoch), 0), self.max_epochs - 1)
        key = (batch_size, e) if type(batch_size) in (int, float) else None
        hit = self._stats.get(key)  # kept: jobs of one model meet the same (batch, epoch) again and again
        if hit is None:
            hit = (float(np.interp(batch_size, self.batch_sizes, self._sqr[:, e])),
                   float(np.interp(batch_size, self.batch_sizes, self._var[:, e])))
            if key is not None:
                if len(self._stats) >= 1 << 16:
                    self._stats.clear()
                self._stats[key] = hit
        return hit

    def grad_stats_table(self, batch_size: float):
        """(sqr, var) arrays over all epochs at ``batch_size`` (for oracle iteration counts); read-only,
        computed once per batch size (Optimus asks for it every round for every job)."""
        key = ("grad_stats_table", float(batch_size))
        hit = self._cache.get(key)
        if hit is None:
            epochs = range(self.max_epochs)
            sqr = np.array([np.interp(batch_size, self.batch_sizes, self._sqr[:, e]) for e in epochs])
            var = np.array([np.interp(batch_size, self.batch_sizes, self._var[:, e]) for e in epochs])
            sqr.setflags(write=False)
            var.setflags(write=False)
            hit = self._cache[key] = (sqr, var)
        return hit

    # ---- throughput
    def step_time(self, placement, local_bsz: float) -> tuple[float, float]:
        """True (optimizer-step time, its sync part) in seconds on ``placement`` (GPUs per node)."""
        key = (canonical_placement(placement), float(local_bsz))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        p = key[0]
        if not p:
            raise ValueError("step_time of an empty placement")
        if p in self._by_placement:
            b, st, sy = self._by_placement[p]
            ret = (float(np.interp(local_bsz, b, st)), float(np.interp(local_bsz, b, sy)))
        else:
            if self._nd is None:
                from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator

                self._nd = (LinearNDInterpolator(self._nd_points, self._nd_values),
                            NearestNDInterpolator(self._nd_points, self._nd_values))
            q = np.array([[min(len(p), 16), sum(p), float(local_bsz)]])
            val = self._nd[0](q)[0]
            if not np.all(np.isfinite(val)):  # outside the measured hull: nearest measurement
                val = self._nd[1](q)[0]
            ret = (float(val[0]), float(val[1]))
        self._cache[key] = ret
        return ret

    @functools.cached_property
    def throughput_model(self):
        """Pollux theta_sys fitted to every measured (placement, per-GPU batch) of this model; the fit is
        cached on disk ($XDG_CACHE_HOME/elasticlab), keyed by a hash of the traces and of the fitting code
        (:func:`fit_code_version`), so a change to the fit is never served a stale model."""
        from elasticlab.goodput import ThroughputModel, fit_throughput_model

        pl, sc = self.placements, self.scalability
        rows = np.vstack([
            np.column_stack([pl.num_nodes, pl.num_replicas, pl.local_bsz, np.zeros(len(pl)), pl.step_time,
                             np.minimum(pl.sync_time, 0.999 * pl.step_time)]),
            np.column_stack([sc.num_nodes, sc.num_replicas, sc.local_bsz, np.zeros(len(sc)), sc.step_time,
                             np.minimum(sc.sync_time, 0.999 * sc.step_time)]),
        ]).astype(float)
        key = hashlib.sha1(rows.tobytes() + fit_code_version().encode()).hexdigest()[:16]
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "elasticlab"
        path = cache / f"throughput-{self.name}-{key}.json"
        try:
            return ThroughputModel(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            pass
        model = fit_throughput_model(rows, prior=None)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(model.as_dict()))
            os.replace(tmp, path)
        except OSError:
            pass
        return model

    # ---- helpers for policies
    def batch_split(self, batch_size: float, replicas: int) -> tuple[int, int]:
        """Fixed global batch on ``replicas`` GPUs -> (per-GPU batch, accumulation steps), artifact rules."""
        local = math.ceil(batch_size / replicas - 1e-8)
        accum = math.ceil(local / self.max_local_bsz - 1e-8) - 1
        if replicas == 1 and batch_size > self.init_batch_size:
            accum = max(1, accum)
        atomic = math.ceil(local / (accum + 1) - 1e-8)
        count = replicas * (accum + 1)
        atomic = min(atomic, int(self.max_batch_size / count))
        return max(atomic, 1), accum

    def iteration_time(self, placement, atomic_bsz, accum_steps) -> float:
        """True seconds of one optimizer step with ``accum_steps`` accumulation micro-steps."""
        step, sync = self.step_time(placement, atomic_bsz)
        return step + accum_steps * (step - sync)


@functools.cache
def _load(name: str, root: str) -> Application:
    return Application(name, Path(root))


def load_application(name: str, root=None) -> Application:
    """Cached :class:`Application` (traces are read once per process)."""
    if name not in APPLICATIONS:
        raise ValueError(f"unknown application {name!r}; expected one of {APPLICATIONS}")
    return _load(name, str(Path(root) if root is not None else data_dir()))
