"""Exact allocation of GPUs to jobs by dynamic programming (Saxena et al., MASCOTS 2020, the DP of Sec. III).

Maximise  sum_j utility[j, g_j]  subject to  sum_j g_j <= capacity  and  min_j <= g_j <= max_j.
``utility[j, g]`` is job j's value at g GPUs (the best batch size for g GPUs is already folded in);
``-inf`` marks a count that job j cannot run at.

Exact solvers, compiled:

* when every row is concave on its feasible range (a contiguous run of finite values with non-increasing
  marginal gains) the rows are merged greedily: the optimum takes the largest positive marginal gains
  first (O(J G log(J G)));
* a table with a non-concave row goes to the hull-bound path (:mod:`elasticlab.alloc.hull`), which keeps
  each job to the counts that can be optimal and runs the DP over those;
* otherwise (``method="dp"``, or when pruning would not pay) the rows that are not concave go through the
  knapsack-style DP  P_j(k) = max_g u_j(g) + P_{j-1}(k - g)  (O(J K G)), combined with the greedy curve of
  the concave rows in one max-plus step.

Columns past a row's last finite entry are never read. Ties (allocations of equal objective) may be
broken differently by the different paths.
"""
from __future__ import annotations

import numba
import numpy as np

from elasticlab.alloc.heap import _heap_pop, _heap_push
from elasticlab.alloc.hull import _solve_bound

__all__ = ["dp_allocate", "dp_allocate_reference", "allocation_value", "is_concave_row"]

_NEG = -np.inf


@numba.njit(cache=True)
def _scan_row(r, lo, hi, tol):
    """One pass over row r on [lo, hi]: (first, last) feasible count, and whether the feasible counts are
    contiguous with non-increasing marginal gains (the condition for the greedy path)."""
    a = -1
    b = -1
    concave = True
    gap = False
    d_prev = np.inf
    for g in range(lo, hi + 1):
        v = r[g]
        if v > _NEG:
            if a < 0:
                a = g
            elif gap:
                concave = False
            else:
                d = v - r[g - 1]
                if d > d_prev + tol:
                    concave = False
                d_prev = d
            b = g
        elif a >= 0:
            gap = True
    return a, b, concave


@numba.njit(cache=True)
def _check_table(u):
    """(code, j, g, scale, last): code 1 = NaN at (j, g), 2 = +inf at (j, g), else 0, max |finite entry| and
    each row's last finite column (-1 for none)."""
    scale = 1.0
    last = np.full(u.shape[0], -1, dtype=np.int64)
    for j in range(u.shape[0]):
        for g in range(u.shape[1]):
            v = u[j, g]
            if v != v:
                return 1, j, g, scale, last
            if v == np.inf:
                return 2, j, g, scale, last
            if v > _NEG:
                last[j] = g
                m = abs(v)
                if m > scale:
                    scale = m
    return 0, -1, -1, scale, last


@numba.njit(cache=True)
def _all_concave(u, lo, hi, tol):
    for j in range(u.shape[0]):
        a, _, concave = _scan_row(u[j], lo[j], hi[j], tol)
        if a >= 0 and not concave:
            return False
    return True


@numba.njit(cache=True)
def _solve(u, lo, hi, capacity, use_greedy, tol):
    """Return (status, alloc); status 0 = ok, 1 = infeasible."""
    J = u.shape[0]
    alloc = np.zeros(J, dtype=np.int64)
    first = np.empty(J, dtype=np.int64)
    last = np.empty(J, dtype=np.int64)
    conc = np.zeros(J, dtype=np.bool_)
    min_total = 0
    n_conc = 0
    for j in range(J):
        a, b, concave = _scan_row(u[j], lo[j], hi[j], tol)
        if a < 0:
            return 1, alloc
        first[j] = a
        last[j] = b
        min_total += a
        if use_greedy and concave:
            conc[j] = True
            n_conc += 1
    if min_total > capacity:
        return 1, alloc

    # --- greedy curve of the concave rows: prefix[t] = best gain from t extra GPUs beyond their minimum.
    # Each concave row's marginal gains are non-increasing, so a J-way merge (max-heap) yields the
    # globally largest gains in order.
    base_c = 0.0
    min_c = 0
    for j in range(J):
        if conc[j]:
            base_c += u[j, first[j]]
            min_c += first[j]
    budget = capacity - min_total  # GPUs beyond every job's minimum
    heap_v = np.empty(n_conc, dtype=np.float64)
    heap_j = np.empty(n_conc, dtype=np.int64)
    nxt = first.copy()
    n_heap = 0
    for j in range(J):
        if conc[j] and first[j] < last[j]:
            d = u[j, first[j] + 1] - u[j, first[j]]
            if d > 0.0:
                n_heap = _heap_push(heap_v, heap_j, n_heap, d, j)
    prefix = np.zeros(budget + 1, dtype=np.float64)
    taken = np.empty(budget, dtype=np.int64)
    n_take_max = 0
    while n_take_max < budget and n_heap > 0:
        d = heap_v[0]
        j = heap_j[0]
        n_heap = _heap_pop(heap_v, heap_j, n_heap)
        prefix[n_take_max + 1] = prefix[n_take_max] + d
        taken[n_take_max] = j
        n_take_max += 1
        nxt[j] += 1
        g = nxt[j]
        if g < last[j]:
            d2 = u[j, g + 1] - u[j, g]
            if d2 > 0.0:
                n_heap = _heap_push(heap_v, heap_j, n_heap, d2, j)

    # --- DP over the other rows (exact count k).
    n_dp = J - n_conc
    K = capacity
    choice = np.zeros((n_dp, K + 1), dtype=np.int32)
    P = np.full(K + 1, _NEG)
    Q = np.empty(K + 1, dtype=np.float64)
    P[0] = 0.0
    reach_lo = 0
    reach_hi = 0
    r = 0
    dp_rows = np.empty(n_dp, dtype=np.int64)
    for j in range(J):
        if conc[j]:
            continue
        dp_rows[r] = j
        a = first[j]
        b = last[j]
        new_lo = reach_lo + a
        new_hi = min(K, reach_hi + b)
        for k in range(K + 1):
            Q[k] = _NEG
        for g in range(a, b + 1):
            v = u[j, g]
            if not (v > _NEG):
                continue
            top = min(new_hi, reach_hi + g)
            for k in range(reach_lo + g, top + 1):
                s = v + P[k - g]
                if s > Q[k]:
                    Q[k] = s
                    choice[r, k] = g
        for k in range(K + 1):
            P[k] = Q[k]
        reach_lo = new_lo
        reach_hi = new_hi
        r += 1

    # --- combine: k GPUs for the DP rows, the rest (at most) for the concave rows.
    best = _NEG
    best_k = -1
    for k in range(reach_lo, reach_hi + 1):
        if not (P[k] > _NEG):
            continue
        rest = capacity - k - min_c
        if rest < 0:
            continue
        t = min(rest, n_take_max)
        v = P[k] + base_c + prefix[t]
        if v > best:
            best = v
            best_k = k
    if best_k < 0:
        return 1, alloc
    # backtrack the DP rows
    k = best_k
    for rr in range(n_dp - 1, -1, -1):
        g = choice[rr, k]
        alloc[dp_rows[rr]] = g
        k -= g
    # greedy rows: their first feasible count plus the gains taken
    for j in range(J):
        if conc[j]:
            alloc[j] = first[j]
    t = min(capacity - best_k - min_c, n_take_max)
    for q in range(t):
        alloc[taken[q]] += 1
    return 0, alloc


def _validate(utility, capacity, min_gpus, max_gpus):
    u = np.asarray(utility, dtype=np.float64)
    if u.ndim != 2 or u.shape[1] < 1:
        raise ValueError(f"utility must be a 2-D array of shape (jobs, capacity+1), got shape {u.shape}")
    if isinstance(capacity, bool) or int(capacity) != capacity:
        raise ValueError(f"capacity must be an integer, got {capacity!r}")
    capacity = int(capacity)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    u = np.ascontiguousarray(u)
    code, j, g, scale, last = _check_table(u)
    if code == 1:
        raise ValueError(f"utility contains NaN (first at job {j}, {g} GPUs)")
    if code == 2:
        raise ValueError(f"utility contains +inf (first at job {j}, {g} GPUs); -inf marks infeasible counts")
    J, W = u.shape
    top = min(W - 1, capacity)

    def bounds(x, name, default):
        """(int64 counts clipped to top + 1, the values as given as float64) of a per-job bound."""
        if x is None:
            arr = np.full(J, float(default))
            return arr.astype(np.int64), arr
        try:
            arr = np.asarray(x, dtype=np.float64)  # any size of integer; 10**30 -> 1e30
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{name} must be whole numbers >= 0 (a scalar or one per job), "
                             f"got {x!r}") from None
        if arr.ndim == 0:
            arr = np.full(J, float(arr))
        if arr.shape != (J,):
            raise ValueError(f"{name} must be a scalar or have shape ({J},), got shape {arr.shape}")
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            j = int(np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))[0])
            raise ValueError(f"{name} must hold whole numbers, got {arr[j].item()!r} for job {j}")
        if np.any(arr < 0):
            j = int(np.argmax(arr < 0))
            raise ValueError(f"{name} must be >= 0, got {arr[j]:g} for job {j}")
        # a bound above the table width or the capacity is no bound: clip before the integer cast
        return np.minimum(arr, top + 1).astype(np.int64), arr

    lo, lo_given = bounds(min_gpus, "min_gpus", 0)
    hi = np.minimum(bounds(max_gpus, "max_gpus", top)[0], top)
    bad = np.flatnonzero(lo > hi)
    if not bad.size:  # counts past a row's last finite entry are infeasible: the solvers never look there
        hi = np.maximum(np.minimum(hi, last), lo)
    if bad.size and (min_gpus is not None):
        j = int(bad[0])
        raise ValueError(
            f"infeasible: job {j} needs at least {lo_given[j]:g} GPUs but at most {hi[j]} are possible "
            f"(max_gpus, table width {W} and capacity {capacity})")
    return u, capacity, lo, hi, scale


def dp_allocate(utility, capacity, min_gpus=None, max_gpus=None, *, method="auto", tol=1e-12):
    """GPU counts maximising sum_j utility[j, g_j] with sum_j g_j <= capacity (Saxena et al. DP).

    utility: (J, W) array, W <= capacity+1 usual W == capacity+1; columns beyond ``capacity`` are ignored and
    counts beyond W-1 are infeasible; ``-inf`` marks an infeasible count. min_gpus / max_gpus: per-job
    bounds (scalars or length-J). method: "auto" (greedy for concave rows, DP for the rest) or "dp"
    (DP for all rows). Returns an int64 array of length J. Raises ValueError when no allocation is
    feasible or the input is malformed.
    """
    if method not in ("auto", "dp"):
        raise ValueError(f"method must be 'auto' or 'dp', got {method!r}")
    u, capacity, lo, hi, scale = _validate(utility, capacity, min_gpus, max_gpus)
    if u.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    if np.any(lo > hi):
        j = int(np.flatnonzero(lo > hi)[0])
        raise ValueError(f"infeasible: job {j} cannot get {lo[j]} GPUs within capacity {capacity}")
    # never more GPUs than the jobs can use together: the DP's memory and time grow with the capacity
    cap = min(capacity, int(hi.sum()))
    status = 2
    if method == "auto" and not _all_concave(u, lo, hi, tol * scale):
        # J K G: what the plain DP would cost; the pruned DP runs when it is cheaper than a tenth of that
        plain = u.shape[0] * (cap + 1) * (int(np.max(hi - lo)) + 1 if len(hi) else 1)
        status, alloc = _solve_bound(u, lo, hi, cap, tol * scale, max(plain // 10, 1))
    if status == 2:
        status, alloc = _solve(u, lo, hi, cap, method == "auto", tol * scale)
    if status:
        raise ValueError(
            f"infeasible allocation: {u.shape[0]} jobs cannot all get a feasible GPU count within capacity "
            f"{capacity} (sum of smallest feasible counts exceeds it, or a job has no feasible count)")
    return alloc


def allocation_value(utility, alloc) -> float:
    """Objective sum_j utility[j, alloc[j]]."""
    u = np.asarray(utility, dtype=np.float64)
    a = np.asarray(alloc, dtype=np.int64)
    if not a.size:
        return 0.0
    if u.ndim != 2 or a.shape != (u.shape[0],):
        raise ValueError(f"alloc must hold one GPU count per row of utility {u.shape}, got shape {a.shape}")
    if not (a.min() >= 0 and a.max() < u.shape[1]):
        raise ValueError(f"alloc entries must be in [0, {u.shape[1] - 1}] (utility's columns), got "
                         f"{a.tolist()}")
    return float(u[np.arange(len(a)), a].sum())


def is_concave_row(row, tol=1e-12) -> bool:
    """True when the finite entries of ``row`` are contiguous with non-increasing marginal gains."""
    r = np.ascontiguousarray(row, dtype=np.float64)
    a, _, concave = _scan_row(r, 0, r.shape[0] - 1, tol)
    return bool(a >= 0 and concave)


def dp_allocate_reference(utility, capacity, min_gpus=None, max_gpus=None):
    """Pure-Python DP (same recurrence, no compilation, no greedy path): the baseline of bench_alloc.py."""
    u, capacity, lo, hi, _ = _validate(utility, capacity, min_gpus, max_gpus)
    J = u.shape[0]
    capacity = min(capacity, int(hi.sum()))  # what the jobs can use together
    rows = u.tolist()
    P = [0.0] + [_NEG] * capacity
    choices = []
    for j in range(J):
        row = rows[j]
        Q = [_NEG] * (capacity + 1)
        ch = [-1] * (capacity + 1)
        for k in range(capacity + 1):
            best, arg = _NEG, -1
            for g in range(int(lo[j]), min(int(hi[j]), k) + 1):
                p = P[k - g]
                v = row[g]
                if p != _NEG and v != _NEG and v + p > best:
                    best, arg = v + p, g
            Q[k], ch[k] = best, arg
        P = Q
        choices.append(ch)
    k = max(range(capacity + 1), key=lambda i: P[i])
    if P[k] == _NEG:
        raise ValueError(f"infeasible allocation: {J} jobs within capacity {capacity}")
    alloc = np.zeros(J, dtype=np.int64)
    for j in range(J - 1, -1, -1):
        alloc[j] = choices[j][k]
        k -= alloc[j]
    return alloc
