"""The per-shape choices of the norm forms, kept: saved to a file, read back, and agreed across DDP ranks.

:mod:`~elasticlab.gns.triton_tune` (which Triton form of a sequence Linear) and, where on,
:mod:`~elasticlab.gns.calibrate` (which form of each layer) choose by timing each shape's candidates at its
first call, as ``torch.backends.cudnn.benchmark`` does. Those choices live in the process. Timing noise can
make two runs, or two DDP ranks of one run, keep different forms: the same sums in other orders, so slightly
other rounding, and in a synchronous step the slowest rank's choice sets the pace. So:

- :func:`save` writes every choice made so far to a JSON file (atomically: a crash mid-write leaves the old
  file), with the GPU and the torch and Triton versions that measured them; :func:`load` takes them back
  (a rerun, a restarted or resized worker), as if measured: those shapes run their kept form without
  timing. Choices measured on another GPU model are not taken (a warning says so).
- :func:`agree` (a collective: every rank calls it, e.g. after the first step) makes each rank take rank
  ``src``'s choices.

Keys hold the layer's dtype and device; a device is kept by its type and taken back as the local one (a
rank's own GPU).
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings

import torch

from elasticlab.gns import calibrate, triton_tune

FORMAT = 1
_TUNERS = {"triton_tune": triton_tune, "calibrate": calibrate}      # name in the file: the module


def _enc(x):
    """A key part as JSON: dtypes, devices (by type) and tuples tagged; numbers, strings, None as is."""
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": x.type}
    if isinstance(x, tuple):
        return {"tuple": [_enc(v) for v in x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"choices: cannot save a key part of type {type(x).__name__}: {x!r}")


def _dec(x, device: torch.device):
    if isinstance(x, dict):
        if "dtype" in x:
            dt = getattr(torch, x["dtype"], None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"choices: unknown dtype {x['dtype']!r}")
            return dt
        if "device" in x:
            return device if x["device"] == device.type else torch.device(x["device"])
        if "tuple" in x:
            return tuple(_dec(v, device) for v in x["tuple"])
        raise ValueError(f"choices: unknown key part {x!r}")
    return x


def _device_name(kind: str) -> str:
    """The model of the GPU that measures (its current CUDA device), or "cpu"."""
    if kind == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"


def _versions() -> dict:
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    return {"torch": torch.__version__, "triton": tv}


def _kept(name: str) -> dict[tuple, tuple]:
    """{key: (form, config or None, {form: seconds})} of tuner ``name``."""
    tuner = _TUNERS[name]
    if name == "triton_tune":
        times = tuner.tunings()
        return {k: (form, config, times.get(k, {})) for k, (form, config) in tuner.kept().items()}
    times = tuner.timings()
    return {k: (form, None, times.get(k, {})) for k, form in tuner.kept().items()}


def snapshot() -> dict:
    """Every choice made so far, as JSON data: {"format", "torch", "triton" (versions), "devices": {type:
    model that measured}, "triton_tune" and "calibrate": [{"key", "form", "config", "times"}]}."""
    out, kinds = {"format": FORMAT, **_versions()}, set()
    for name in _TUNERS:
        kept = _kept(name)
        out[name] = [{"key": _enc(tuple(key)), "form": form, "config": config and list(config), "times": t}
                     for key, (form, config, t) in kept.items()]
        kinds.update(p.type for key in kept for p in key if isinstance(p, torch.device))
    out["devices"] = {k: _device_name(k) for k in sorted(kinds)}
    return out


def restore(snap: dict, device: torch.device | None = None, replace: bool = False) -> int:
    """Takes the choices of a :func:`snapshot` (``device``: the local device its keys' devices become; None,
    the current CUDA device, or the CPU without CUDA); with ``replace`` over this process's own, else only
    for shapes not yet chosen here. Those measured on another GPU model are left out with a warning.
    Returns how many were taken."""
    if not isinstance(snap, dict) or snap.get("format") != FORMAT:
        got = snap.get("format") if isinstance(snap, dict) else type(snap).__name__
        raise ValueError(f"choices: not an elasticlab choices snapshot of format {FORMAT} (got {got!r})")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    other = {k: model for k, model in snap.get("devices", {}).items() if model != _device_name(k)}
    if other:
        warnings.warn("choices: measured on " + ", ".join(other.values()) + ", not here ("
                      + ", ".join(_device_name(k) for k in other) + "): those are not taken", RuntimeWarning,
                      stacklevel=2)
    mine = _versions()
    if any(snap.get(k) != v for k, v in mine.items()):
        warnings.warn(f"choices: measured with torch {snap.get('torch')} / Triton {snap.get('triton')}, "
                      f"taken with torch {mine['torch']} / Triton {mine['triton']}", RuntimeWarning,
                      stacklevel=2)
    taken = 0
    for name, tuner in _TUNERS.items():
        have = _kept(name)
        for row in snap.get(name, []):
            key = _dec(row["key"], device)
            elsewhere = any(isinstance(p, torch.device) and p.type in other for p in key)
            if elsewhere or key in have and not replace:
                continue
            times = {k: float(v) for k, v in row.get("times", {}).items()}
            if name == "triton_tune":
                tuner.keep(key, (row["form"], row.get("config")), times)
            else:
                tuner.keep(key, row["form"], times)
            taken += 1
    return taken


def save(path: str | os.PathLike) -> int:
    """Writes :func:`snapshot` to ``path`` (JSON), atomically: to a temporary file beside it, then renamed
    over it. Returns how many choices it holds."""
    snap = snapshot()
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".choices-", suffix=".json", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(snap, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return sum(len(snap[n]) for n in _TUNERS)


def load(path: str | os.PathLike, device: torch.device | None = None, replace: bool = False) -> int:
    """Takes the choices saved in ``path`` (:func:`restore`); returns how many. A file that is not such a
    snapshot raises a ValueError naming it."""
    try:
        with open(path) as f:
            snap = json.load(f)
        return restore(snap, device, replace)
    except (json.JSONDecodeError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"choices: cannot load {os.fspath(path)!r}: {e}") from e


def agree(group=None, src: int = 0) -> int:
    """Every rank of ``group`` (default: the whole job) takes rank ``src``'s choices over its own, for the
    shapes ``src`` has chosen: a collective (``broadcast_object_list``), so every rank calls it at the same
    point, e.g. after the first step (``src``: a global rank). Without an initialised process group,
    nothing (0). Returns how many this rank took."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    box = [snapshot() if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return restore(box[0], replace=True)
