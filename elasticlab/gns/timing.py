"""Device time of one call, the timer shared by the per-shape choices (:mod:`elasticlab.gns.calibrate`'s
forms, :mod:`elasticlab.gns.triton_outer`'s kernel variants)."""
from __future__ import annotations

import time
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
