"""A max-heap of (value, job) pairs in two preallocated arrays, for the allocator's numba kernels (the greedy
merge of marginal gains in :mod:`elasticlab.alloc.dp`, of hull segments in :mod:`elasticlab.alloc.hull`)."""
from __future__ import annotations

import numba


@numba.njit(cache=True)
def _heap_push(hv, hj, n, v, j):
    i = n
    hv[i] = v
    hj[i] = j
    while i > 0:
        p = (i - 1) // 2
        if hv[p] >= hv[i]:
            break
        hv[p], hv[i] = hv[i], hv[p]
        hj[p], hj[i] = hj[i], hj[p]
        i = p
    return n + 1


@numba.njit(cache=True)
def _heap_pop(hv, hj, n):
    n -= 1
    hv[0] = hv[n]
    hj[0] = hj[n]
    i = 0
    while True:
        left = 2 * i + 1
        m = i
        if left < n and hv[left] > hv[m]:
            m = left
        if left + 1 < n and hv[left + 1] > hv[m]:
            m = left + 1
        if m == i:
            break
        hv[m], hv[i] = hv[i], hv[m]
        hj[m], hj[i] = hj[i], hj[m]
        i = m
    return n
