"""The compiled half of :meth:`GoodputFunction.optimize <elasticlab.goodput.GoodputFunction.optimize>`:
given a cached candidate grid's THROUGHPUT and M (which phi does not enter), the goodput of every candidate
and the best one per allocation in one call (issue 19: the simulator re-chooses a job's batch after nearly
every step, and numpy's per-call overhead on 50-100 candidates dominated that choice).

Imported on first use (numba is slow to import). :func:`best_candidates` gives exactly what the numpy
reference :func:`elasticlab.goodput.function._best_numpy` gives: the efficiency is the same Python
expression (:func:`~elasticlab.goodput.efficiency._efficiency_formula`, compiled here), the product and the
argmax follow numpy's order (first maximum; a NaN wins, as in ``np.argmax``); no fast-math.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from elasticlab.goodput.efficiency import _efficiency_formula

# error_model="numpy": a division by zero gives inf / nan (IEEE), as numpy does, instead of raising
_eff = numba.njit(cache=True, error_model="numpy")(_efficiency_formula)


@numba.njit(cache=True, error_model="numpy")
def _best_in_row(i, throughput, batch, ok, phi, m0):
    """Row i: ``GOODPUT = THROUGHPUT x EFFICIENCY(M)`` of each feasible candidate (-inf elsewhere) and the
    first maximum (a NaN wins, as in ``np.argmax``): ``(its goodput, its column)``."""
    top = -np.inf
    best = 0
    for j in range(throughput.shape[1]):
        v = throughput[i, j] * _eff(phi, m0, batch[i, j]) if ok[i, j] else -np.inf
        if j == 0 or not v <= top:
            top = v
            best = j
            if math.isnan(v):
                break
    return top, best


@numba.njit(cache=True, error_model="numpy")
def best_candidates(throughput, batch, per_gpu, steps, ok, phi, m0):
    """Per row (allocation) of the (A, C) candidate grid: the best feasible candidate's ``(goodput, per-GPU
    batch, accumulation steps)`` (:func:`_best_in_row`); ``(0, 0, 0)`` where its goodput is not finite (no
    feasible candidate)."""
    rows = throughput.shape[0]
    good = np.zeros(rows)
    b = np.zeros(rows, dtype=np.int64)
    s = np.zeros(rows, dtype=np.int64)
    for i in range(rows):
        top, best = _best_in_row(i, throughput, batch, ok, phi, m0)
        if math.isfinite(top):
            good[i] = top
            b[i] = np.int64(per_gpu[i, best])
            s[i] = np.int64(steps[i, best])
    return good, b, s


@numba.njit(cache=True, error_model="numpy")
def best_candidate(throughput, batch, per_gpu, steps, ok, phi, m0):
    """:func:`best_candidates` of a one-row grid as plain numbers ``(goodput, b, s)`` (no arrays to box:
    the simulator's per-step choice for one allocation)."""
    top, best = _best_in_row(0, throughput, batch, ok, phi, m0)
    if math.isfinite(top):
        return top, np.int64(per_gpu[0, best]), np.int64(steps[0, best])
    return 0.0, np.int64(0), np.int64(0)
