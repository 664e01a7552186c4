"""Device time of one call, and the fastest of several interchangeable calls: what the per-shape choices
share (:mod:`elasticlab.gns.calibrate`'s forms, :mod:`elasticlab.gns.triton_tune`'s Triton forms)."""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch


def elapsed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Seconds of one call of ``fn``: the best of ``repeats`` calls, between CUDA events on a GPU (the stream
    is drained at each call's end), by the wall clock elsewhere. The caller warms ``fn`` up first (a Triton
    kernel compiles at its first call)."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        if device.type == "cuda":
            with torch.cuda.device(device):          # the events on the stream of the device that runs fn
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                fn()
                t1.record()
                t1.synchronize()
            best = min(best, t0.elapsed_time(t1) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best


def fastest(forms: dict[str, Callable[[], object]], device: torch.device, repeats: int,
            label: str) -> tuple[str, object, dict[str, float]]:
    """(name, result, {name: seconds}) of the fastest of ``forms`` (name → call; their results
    interchangeable): each called once to warm up (Triton compiles there), then timed by :func:`elapsed`. A
    form that raises is left out, with a RuntimeWarning "``label``: {name: error}"; if all raise, the last
    error propagates."""
    best_name, best_out, best_t, times, err, failed = None, None, float("inf"), {}, None, {}
    for name, fn in forms.items():
        try:
            out = fn()
            t = elapsed(fn, device, repeats)
        except Exception as e:       # e.g. Triton's OutOfResources for this tile, CUDA out of memory
            err, failed[name] = e, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            continue
        times[name] = t
        if t < best_t:
            best_name, best_out, best_t = name, out, t
        del out
    if best_name is None:
        raise err if err is not None else ValueError(f"{label}: no form to time")
    if failed:
        warnings.warn(f"{label}: {failed}", RuntimeWarning, stacklevel=3)
    return best_name, best_out, times
