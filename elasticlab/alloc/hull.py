"""The allocator's hull-bound path (issue 19): exact allocation on non-concave utility tables.

Speedups that drop when a job crosses a node boundary make rows non-concave, which the greedy of
:mod:`elasticlab.alloc.dp` cannot take. Each row's upper concave hull gives a Lagrangian relaxation: the
greedy over hull segments by slope is its optimum (an upper bound UB, multiplier lambda = the last slope
taken), and whole segments only give a feasible point (a lower bound LB). A count whose reduced cost
exceeds UB - LB cannot be in any optimum, so most jobs keep a single count and the knapsack DP runs over
the few counts left of the few jobs left. Exact; the caller falls back to the plain DP when the pruned DP
would not be much cheaper.
"""
from __future__ import annotations

import numba
import numpy as np

from elasticlab.alloc.heap import _heap_pop, _heap_push

_NEG = -np.inf


@numba.njit(cache=True)
def _hull(r, a, b, vx, vy, off):
    """Upper concave hull of the finite entries of row r on [a, b], written to vx/vy[off:]; returns the
    number of vertices (collinear points dropped, so the slopes strictly decrease)."""
    n = 0
    for g in range(a, b + 1):
        v = r[g]
        if not (v > _NEG):
            continue
        while n >= 2:
            x1 = vx[off + n - 2]
            y1 = vy[off + n - 2]
            x2 = vx[off + n - 1]
            y2 = vy[off + n - 1]
            if (y2 - y1) * (g - x2) <= (v - y2) * (x2 - x1):
                n -= 1
            else:
                break
        vx[off + n] = g
        vy[off + n] = v
        n += 1
    return n


@numba.njit(cache=True)
def _hull_greedy(vx, vy, voff, vn, budget, blocks):
    """Greedy over the hulls' segments by slope (a J-way heap merge). ``blocks=False``: the fractional
    optimum of the hull relaxation (the last segment taken in part), returning (x, lambda); ``blocks=True``:
    whole segments only, a job whose next segment does not fit stops (a feasible point at hull vertices)."""
    J = voff.shape[0]
    x = np.empty(J, dtype=np.int64)
    pos = np.zeros(J, dtype=np.int64)
    hv = np.empty(J, dtype=np.float64)
    hj = np.empty(J, dtype=np.int64)
    n = 0
    for j in range(J):
        o = voff[j]
        x[j] = vx[o]
        if vn[j] > 1:
            s = (vy[o + 1] - vy[o]) / (vx[o + 1] - vx[o])
            if s > 0.0:
                n = _heap_push(hv, hj, n, s, j)
    lam = 0.0
    while n > 0:
        s = hv[0]
        j = hj[0]
        n = _heap_pop(hv, hj, n)
        o = voff[j] + pos[j]
        length = vx[o + 1] - vx[o]
        if length <= budget:
            budget -= length
            pos[j] += 1
            x[j] = vx[o + 1]
            if pos[j] + 1 < vn[j]:
                o += 1
                s2 = (vy[o + 1] - vy[o]) / (vx[o + 1] - vx[o])
                if s2 > 0.0:
                    n = _heap_push(hv, hj, n, s2, j)
            if budget == 0 and not blocks:
                lam = hv[0] if n > 0 else 0.0
                break
        elif not blocks:
            x[j] += budget
            lam = s
            break
    return x, lam


@numba.njit(cache=True)
def _solve_bound(u, lo, hi, capacity, tol, max_work):
    """Exact, for any rows: Lagrangian bounds from the rows' concave hulls keep each job to the few counts
    that can be optimal, and the DP runs over those only. status 0 = ok, 1 = infeasible, 2 = the pruned DP
    would cost more than ``max_work`` (the caller falls back to the plain DP).

    With lambda the hull greedy's last slope, h_j = max_g hull_j(g) - lambda g and UB = sum_j h_j + lambda K,
    every allocation x with sum x <= K has  sum_j u_j(x_j) = UB - sum_j r_j(x_j) - lambda (K - sum x),
    r_j(g) = h_j - (u_j(g) - lambda g) >= 0. Any feasible point gives LB, so an optimum has r_j(x_j) <=
    UB - LB for every j: counts with a larger reduced cost are dropped; most jobs keep one count."""
    J = u.shape[0]
    alloc = np.zeros(J, dtype=np.int64)
    first = np.empty(J, dtype=np.int64)
    voff = np.empty(J, dtype=np.int64)
    total = 0
    for j in range(J):
        voff[j] = total
        if hi[j] >= lo[j]:
            total += hi[j] - lo[j] + 1
    vx = np.empty(max(total, 1), dtype=np.int64)
    vy = np.empty(max(total, 1), dtype=np.float64)
    vn = np.empty(J, dtype=np.int64)
    min_total = 0
    for j in range(J):
        vn[j] = _hull(u[j], lo[j], hi[j], vx, vy, voff[j]) if hi[j] >= lo[j] else 0
        if vn[j] == 0:
            return 1, alloc
        first[j] = vx[voff[j]]
        min_total += first[j]
    if min_total > capacity:
        return 1, alloc
    budget = capacity - min_total
    x, lam = _hull_greedy(vx, vy, voff, vn, budget, False)
    xb, _ = _hull_greedy(vx, vy, voff, vn, budget, True)
    ub = 0.0
    lb = 0.0
    h = np.empty(J, dtype=np.float64)
    for j in range(J):
        o = voff[j]
        k = 0
        while k + 1 < vn[j] and vx[o + k + 1] <= x[j]:
            k += 1
        hval = vy[o + k]
        if vx[o + k] < x[j]:  # inside a segment: linear between its vertices
            hval += (vy[o + k + 1] - vy[o + k]) * (x[j] - vx[o + k]) / (vx[o + k + 1] - vx[o + k])
        h[j] = hval - lam * x[j]
        ub += hval
        lb += u[j, xb[j]]
    gap = ub - lb + tol + 1e-9 * (abs(ub) + abs(lb))  # rounding in the two sums: a wider gap only costs time
    # candidates per job; jobs with one are fixed
    cg = np.empty(max(total, 1), dtype=np.int64)
    cv = np.empty(max(total, 1), dtype=np.float64)
    coff = np.empty(J + 1, dtype=np.int64)
    cmin = np.empty(J, dtype=np.int64)
    cmax = np.empty(J, dtype=np.int64)
    nc = 0
    fixed = 0
    n_free = 0
    span = 0
    work = 0
    for j in range(J):
        coff[j] = nc
        for g in range(lo[j], hi[j] + 1):
            v = u[j, g]
            if v > _NEG and h[j] - (v - lam * g) <= gap:
                cg[nc] = g
                cv[nc] = v
                nc += 1
        m = coff[j]
        cmin[j] = cg[m]
        cmax[j] = cg[nc - 1]
        if nc - m == 1:
            fixed += cg[m]
        else:
            n_free += 1
            span += cmax[j] - cmin[j]
            work += nc - m
    coff[J] = nc
    base = fixed
    for j in range(J):
        if coff[j + 1] - coff[j] > 1:
            base += cmin[j]
    E = min(span, capacity - base)
    if E < 0:
        return 2, alloc
    if work * (E + 1) > max_work:
        return 2, alloc
    # DP over the free jobs, state = GPUs beyond their smallest candidates
    P = np.full(E + 1, _NEG)
    Q = np.empty(E + 1, dtype=np.float64)
    choice = np.zeros((max(n_free, 1), E + 1), dtype=np.int32)
    free_rows = np.empty(max(n_free, 1), dtype=np.int64)
    P[0] = 0.0
    reach = 0
    r = 0
    for j in range(J):
        m = coff[j]
        c = coff[j + 1] - m
        if c == 1:
            alloc[j] = cg[m]
            continue
        free_rows[r] = j
        new_reach = min(E, reach + cmax[j] - cmin[j])
        for k in range(new_reach + 1):
            Q[k] = _NEG
        for q in range(m, m + c):
            d = cg[q] - cmin[j]
            v = cv[q]
            top = min(new_reach, reach + d)
            for k in range(d, top + 1):
                p = P[k - d]
                if p > _NEG:
                    s = p + v
                    if s > Q[k]:
                        Q[k] = s
                        choice[r, k] = d
        for k in range(new_reach + 1):
            P[k] = Q[k]
        reach = new_reach
        r += 1
    best = _NEG
    best_k = -1
    for k in range(reach + 1):
        if P[k] > best:
            best = P[k]
            best_k = k
    if best_k < 0:
        return 2, alloc
    k = best_k
    for rr in range(n_free - 1, -1, -1):
        j = free_rows[rr]
        d = choice[rr, k]
        alloc[j] = cmin[j] + d
        k -= d
    return 0, alloc
