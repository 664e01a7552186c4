"""Placement of GPU counts on nodes (Pollux §4.2 interference avoidance as an option).

``place(counts, previous, num_nodes, gpus_per_node)`` turns per-job GPU counts into per-node tuples:
jobs whose count did not change keep their previous placement (no needless restart); a job that fits on
one node goes to the fullest node that still fits it (best fit); a larger job takes whole free nodes first,
then the nodes with the most free GPUs. With ``one_distributed_per_node`` a node hosts at most one job that
spans several nodes; a job that cannot get all its GPUs then gets what fits (``elastic=True``) or nothing.
``node_sizes`` gives each node's usable GPUs when they differ (a cluster whose capacity is not a multiple
of the node size, :attr:`elasticlab.alloc.policies.Cluster.node_sizes`); no node is ever given more.
"""
from __future__ import annotations

import numpy as np

__all__ = ["place", "node_count"]


def node_count(placement) -> int:
    return int(sum(1 for x in placement if x))


_SPARSE: dict = {}


def _sparse(placement) -> tuple[np.ndarray, np.ndarray]:
    """(nodes used, GPUs on each) of a placement tuple, remembered per tuple: a job keeps its placement for
    many rounds, and converting a 1000-node tuple each round cost more than the rest of a round."""
    hit = _SPARSE.get(placement) if type(placement) is tuple else None
    if hit is None:
        p = np.asarray(placement, dtype=np.int64)
        idx = np.flatnonzero(p)
        hit = (idx, p[idx])
        if type(placement) is tuple:
            if len(_SPARSE) > 8192:
                _SPARSE.clear()
            _SPARSE[placement] = hit
    return hit


def place(counts: dict, previous: dict | None, num_nodes: int, gpus_per_node: int,
          one_distributed_per_node: bool = False, elastic: bool = True, order=None,
          node_sizes=None) -> dict:
    """Per-job placement tuples (length ``num_nodes``) for ``counts`` {job: GPUs}; jobs with 0 are omitted.

    ``order``: the priority in which new jobs are placed (default: largest count first). ``node_sizes``:
    usable GPUs per node (default ``gpus_per_node`` each).
    """
    if num_nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"need num_nodes >= 1 and gpus_per_node >= 1, got {num_nodes}, {gpus_per_node}")
    if node_sizes is None:
        sizes = np.full(num_nodes, gpus_per_node, dtype=np.int64)
    else:
        sizes = np.asarray(node_sizes, dtype=np.int64)
        if sizes.shape != (num_nodes,) or np.any(sizes < 0) or np.any(sizes > gpus_per_node):
            raise ValueError(f"node_sizes must be {num_nodes} counts in [0, {gpus_per_node}], got "
                             f"{tuple(node_sizes)}")
    total = sum(int(c) for c in counts.values())
    bad = [k for k, c in counts.items() if int(c) < 0]
    if bad:
        raise ValueError(f"negative GPU count for job {bad[0]!r}: {counts[bad[0]]}")
    if total > int(sizes.sum()):
        raise ValueError(f"{total} GPUs requested but the cluster has {int(sizes.sum())}")
    previous = previous or {}
    free = sizes.copy()
    dist = np.zeros(num_nodes, dtype=bool)  # node hosts a multi-node job
    out = {}
    # 1. keep unchanged placements (the previous tuple itself: no per-node Python work on big clusters)
    for name, c in sorted(counts.items(), key=lambda kv: -kv[1]):
        prev = previous.get(name)
        if c <= 0 or prev is None or len(prev) != num_nodes:
            continue
        idx, val = _sparse(prev)  # the nodes it uses: O(its nodes) work, not O(the cluster's)
        if int(val.sum()) != c:
            continue
        multi = len(idx) > 1
        if np.any(val > free[idx]) or (one_distributed_per_node and multi and np.any(dist[idx])):
            continue
        free[idx] -= val
        if multi:
            dist[idx] = True
        out[name] = prev if type(prev) is tuple and type(prev[0]) is int else tuple(int(x) for x in prev)
    # 2. place the rest
    rest = [k for k, c in counts.items() if c > 0 and k not in out]
    if order is None:
        rest.sort(key=lambda k: -counts[k])
    else:
        rank = {k: i for i, k in enumerate(order)}
        rest.sort(key=lambda k: rank.get(k, len(rank)))
    for name in rest:
        c = int(counts[name])
        p = np.zeros(num_nodes, dtype=np.int64)
        fits = np.flatnonzero(free >= c)
        if c <= gpus_per_node and fits.size:
            n = fits[np.argmin(free[fits])]  # best fit
            p[n] = c
        else:
            need = c
            eligible = ~dist if one_distributed_per_node else np.ones(num_nodes, dtype=bool)
            whole = np.flatnonzero(eligible & (free == sizes) & (sizes > 0))
            for n in whole:
                if need < sizes[n]:
                    break
                p[n] = sizes[n]
                need -= sizes[n]
            while need > 0:
                cand = np.flatnonzero(eligible & (free - p > 0))
                if cand.size == 0:
                    break
                n = cand[np.argmax(free[cand] - p[cand])]
                take = min(need, int(free[n] - p[n]))
                p[n] += take
                need -= take
            if need > 0 and not elastic:
                continue
            if one_distributed_per_node and np.count_nonzero(p) > 1 and np.any(dist[p > 0]):
                continue
        if p.sum() == 0:
            continue
        free -= p
        if np.count_nonzero(p) > 1:
            dist |= p > 0
        out[name] = tuple(p.tolist())
    return out
