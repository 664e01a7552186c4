"""The scheduler's objective on top of the goodput model: Pollux's FITNESS_p and re-allocation penalty.

Implemented here, in the lower layer, and imported by the allocator from :mod:`elasticlab.alloc.objective`
(the home the policies use). Direction chosen so that no import runs back up: ``alloc`` imports ``goodput``,
``goodput`` never imports ``alloc``, and ``from elasticlab.goodput import fitness, restart_penalty`` keeps
working.
"""
from __future__ import annotations

from numbers import Real

import numpy as np

__all__ = ["fitness", "restart_penalty"]


def fitness(speedups, p=-1.0, axis=-1):
    """Pollux FITNESS_p: power mean ``((1/J) sum_j SPEEDUP_j^p)^(1/p)`` over jobs (``axis``).

    p = 1 is the mean, p = 0 the geometric mean, p -> -inf the minimum (fairest); Pollux uses p = -1.
    Plain numpy (scipy.stats.pmean costs ~50x more per call, and allocators call this in their inner loop).
    """
    x = np.asarray(speedups, dtype=float)
    if x.size == 0:
        raise ValueError("fitness of an empty set of speedups")
    if np.any(x < 0) or np.any(np.isnan(x)):
        raise ValueError(f"speedups must be >= 0, got {speedups}")
    p = float(p)
    if p == -np.inf:
        return np.min(x, axis=axis)
    if p == np.inf:
        return np.max(x, axis=axis)
    if p <= 0:
        # a power mean with p <= 0 is 0 as soon as one job gets speedup 0
        zero = np.any(x == 0, axis=axis)
        x = np.where(x == 0, 1.0, x)
        if p == 0:
            val = np.exp(np.mean(np.log(x), axis=axis))
        else:
            lo = np.min(x, axis=axis, keepdims=True)  # scale out the minimum: no overflow for p << 0
            val = np.squeeze(lo, axis=axis) * np.mean((x / lo) ** p, axis=axis) ** (1.0 / p)
        return np.where(zero, 0.0, val) if np.ndim(val) else (0.0 if zero else float(val))
    hi = np.max(x, axis=axis, keepdims=True)
    hi = np.where(hi > 0, hi, 1.0)
    val = np.squeeze(hi, axis=axis) * np.mean((x / hi) ** p, axis=axis) ** (1.0 / p)
    return val if np.ndim(val) else float(val)


def restart_penalty(age, restarts, delay=30.0):
    """Pollux's re-allocation penalty ``max(T - R * delta, 0) / (T + delta)`` on a job's speedup (§4.2).

    Vectorised over ``age`` (T, seconds since submission) and ``restarts`` (R); two plain numbers (the
    policies' inner loop) skip the array conversion and give a float.
    """
    if not (isinstance(age, Real) and isinstance(restarts, Real)):
        age = np.asarray(age, dtype=float)
        restarts = np.asarray(restarts, dtype=float)
    if np.any(age < 0) or np.any(restarts < 0) or delay < 0:
        raise ValueError(f"age, restarts and delay must be >= 0, got {age}, {restarts}, {delay}")
    return np.maximum(age - restarts * delay, 0.0) / (age + delay)
