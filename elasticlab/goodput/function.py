"""Pollux's GOODPUT = THROUGHPUT x EFFICIENCY (Qiao et al., OSDI 2021, Eq. (1)), the agent's ``(b, s)``
choice (PolluxAgent) and the speedups the scheduler reads.

:func:`goodput` is the one place the product is written: :meth:`GoodputFunction.evaluate` and the candidate
grid behind :meth:`GoodputFunction.optimize` / :meth:`~GoodputFunction.speedup_table` both call it.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from elasticlab.goodput.efficiency import GradParams, _check_positive, _efficiency, efficiency, noise_scale
from elasticlab.goodput.throughput import ThroughputModel, global_batch

__all__ = ["GoodputFunction", "goodput"]


def goodput(model: ThroughputModel, phi, init_batch, nodes, gpus, per_gpu_batch, accum_steps=0):
    """``GOODPUT(N, K, b, s) = M / T_iter * E(M)`` with ``M = K b (s + 1)``, in M0-equivalent samples/s,
    broadcast over all arguments; no input checks (defined for M >= M0, phi >= 0). Outside that domain
    (zero GPUs, a zero batch) the value is what IEEE arithmetic gives (0, inf or nan; callers mask those
    entries) and numpy's divide-by-zero / invalid-value warnings are silenced."""
    thr, batch = _throughput_parts(model, nodes, gpus, per_gpu_batch, accum_steps)
    return _times_efficiency(thr, batch, phi, init_batch)


def _throughput_parts(model: ThroughputModel, nodes, gpus, per_gpu_batch, accum_steps):
    """``(THROUGHPUT, M)`` of the configurations: the half of :func:`goodput` that phi does not enter."""
    gpus = np.asarray(gpus, dtype=float)
    b = np.asarray(per_gpu_batch, dtype=float)
    s = np.asarray(accum_steps, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return model.throughput(nodes, gpus, b, s), global_batch(gpus, b, s)


def _times_efficiency(throughput, batch, phi, init_batch):
    """GOODPUT = THROUGHPUT x EFFICIENCY(M) (Pollux Eq. (1)): the one place the product is written."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return throughput * _efficiency(phi, init_batch, batch)


class GoodputFunction:
    """Pollux GOODPUT: ``GOODPUT(N, K, b, s) = THROUGHPUT * EFFICIENCY(M)`` in M0-equivalent samples/s.

    ``grad_stats``: phi, ``(sqr, var)`` or a GNS estimator object (see :func:`noise_scale`), or give
    Pollux's ``grad_sqr=`` and ``grad_var=`` instead; ``init_batch``: M0, the batch size the job's
    learning rate was tuned for.
    """

    __slots__ = ("model", "phi", "init_batch")

    def __init__(self, throughput_model: ThroughputModel, grad_stats=None, init_batch=None, *,
                 grad_sqr=None, grad_var=None):
        if not isinstance(throughput_model, ThroughputModel):
            raise TypeError(f"throughput_model must be a ThroughputModel, got {type(throughput_model)}")
        if init_batch is None:
            raise ValueError("init_batch (M0) is required")
        _check_positive("init_batch", init_batch)
        if (grad_sqr is None) != (grad_var is None) or (grad_sqr is not None and grad_stats is not None):
            raise ValueError("give either grad_stats or both grad_sqr and grad_var")
        if grad_sqr is not None:
            grad_stats = GradParams(float(grad_sqr), float(grad_var))
        if grad_stats is None:
            raise ValueError("gradient statistics are required: grad_stats, or grad_sqr and grad_var")
        self.model = throughput_model
        self.init_batch = float(init_batch)
        self.phi = noise_scale(grad_stats, self.init_batch)

    def __repr__(self):
        return f"GoodputFunction({self.model}, phi={self.phi:g}, init_batch={self.init_batch:g})"

    def efficiency(self, batch):
        return efficiency(self.phi, self.init_batch, batch)

    def throughput(self, nodes, gpus, per_gpu_batch, accum_steps=0):
        return self.model.throughput(nodes, gpus, per_gpu_batch, accum_steps)

    def evaluate(self, nodes, gpus, per_gpu_batch, accum_steps=0):
        """Goodput of a configuration, broadcast over all arguments (defined for M >= M0)."""
        return goodput(self.model, self.phi, self.init_batch, nodes, gpus, per_gpu_batch, accum_steps)

    def _batch_range(self, max_batch, batch_range):
        m0 = self.init_batch
        if batch_range is not None and np.shape(batch_range) != (2,):
            raise ValueError(f"batch_range must be a pair (min, max) of global batches, got {batch_range!r}")
        if batch_range is None:
            if max_batch is not None and max_batch < m0:
                raise ValueError(f"max_batch {max_batch} is below the initial batch size {m0}")
            batch_range = (m0, m0 if max_batch is None else max_batch)
        elif max_batch is not None and max_batch != batch_range[1]:
            raise ValueError(f"max_batch={max_batch} disagrees with batch_range={batch_range}")
        lo, hi = (float(v) for v in batch_range)
        if not lo <= hi:
            raise ValueError(f"batch_range minimum {lo} is greater than its maximum {hi}")
        if hi < m0:
            raise ValueError(f"the maximum batch size {hi} is below the initial batch size {m0}")
        return max(lo, m0), hi

    def optimize(self, nodes, gpus, *, max_batch=None, batch_range=None, max_per_gpu_batch=None,
                 min_per_gpu_batch=1, max_accum=None, accumulation=True, num_candidates=50,
                 force_accum_single_gpu=True, max_batch_size=None, atomic_bsz_range=None):
        """PolluxAgent's choice: best ``(goodput, per_gpu_batch, accum_steps)`` per allocation.

        Candidates: ``num_candidates`` global batches on a geometric grid over ``batch_range`` (global,
        default ``(M0, max_batch)``; ``max_batch`` defaults to M0, i.e. no batch-size adaptation), from at
        least ``min_per_gpu_batch * K``. Each uses the fewest accumulation steps that keep the per-GPU
        batch within ``max_per_gpu_batch`` (the memory cap) and ``max_accum``. On one GPU a batch above M0
        gets >= 1 accumulation step when ``force_accum_single_gpu`` (Pollux's GNS needs two
        micro-batches). Allocations with no feasible candidate (or zero GPUs) get goodput 0 and b = s = 0.
        Broadcast over ``nodes`` and ``gpus``; scalars in give scalars out. The artifact's keywords
        ``max_batch_size`` (= ``max_batch``) and ``atomic_bsz_range`` (= ``(min_per_gpu_batch,
        max_per_gpu_batch)``) are accepted too.
        """
        kw = dict(max_batch=max_batch, batch_range=batch_range, max_per_gpu_batch=max_per_gpu_batch,
                  min_per_gpu_batch=min_per_gpu_batch, max_accum=max_accum, accumulation=accumulation,
                  num_candidates=num_candidates, force_accum_single_gpu=force_accum_single_gpu,
                  max_batch_size=max_batch_size, atomic_bsz_range=atomic_bsz_range)
        # the candidate grid does not depend on theta_sys or phi: cached across calls (a simulated job asks
        # for the same allocations again and again with new gradient statistics)
        key = _optimize_key(self.init_batch, nodes, gpus, kw)
        cands = _CANDIDATE_CACHE.get(key) if key is not None else None
        if cands is None:
            cands = self._candidates(nodes, gpus, **kw)
            if key is not None:
                cands = cands._replace(nodes=cands.nodes.copy())  # it may view the caller's array
                _keep_candidates(key, cands, 4096)
        return self._pick(cands)

    def _candidates(self, nodes, gpus, *, max_batch=None, batch_range=None, max_per_gpu_batch=None,
                    min_per_gpu_batch=1, max_accum=None, accumulation=True, num_candidates=50,
                    force_accum_single_gpu=True, max_batch_size=None, atomic_bsz_range=None):
        """The (allocation x candidate) grid of (b, s) choices; independent of theta_sys and phi."""
        if max_batch_size is not None:
            if max_batch is not None and max_batch != max_batch_size:
                raise ValueError(f"max_batch={max_batch} disagrees with max_batch_size={max_batch_size}")
            max_batch = max_batch_size
        if atomic_bsz_range is not None:
            min_per_gpu_batch, max_per_gpu_batch = atomic_bsz_range
        lo, hi = self._batch_range(max_batch, batch_range)
        min_b = float(min_per_gpu_batch)
        max_b = np.inf if max_per_gpu_batch is None else float(max_per_gpu_batch)
        if not 1 <= min_b <= max_b:
            raise ValueError(f"need 1 <= min_per_gpu_batch <= max_per_gpu_batch, got {min_b}, {max_b}")
        if max_accum is not None and max_accum < 0:
            raise ValueError(f"max_accum must be >= 0, got {max_accum}")
        if int(num_candidates) < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        nodes_a, gpus_a = np.broadcast_arrays(np.asarray(nodes, dtype=float), np.asarray(gpus, dtype=float))
        if np.any(nodes_a < 0) or np.any(gpus_a < 0):
            raise ValueError(f"nodes and gpus must be >= 0, got nodes={nodes}, gpus={gpus}")
        shape = nodes_a.shape
        n = nodes_a.reshape(-1, 1)
        k = gpus_a.reshape(-1, 1)
        valid = (k >= 1) & (n >= 1) & (n <= k)
        k_safe = np.where(valid, k, 1.0)
        start = np.maximum(lo, min_b * k_safe)
        valid &= start <= hi
        grid = np.linspace(0.0, 1.0, int(num_candidates))
        ratio = np.where(valid, hi / start, 1.0)
        batch = start * ratio**grid  # (n_alloc, C) geometric candidates
        local = batch / k_safe
        if accumulation:
            steps = np.maximum(np.ceil(local / max_b) - 1.0, 0.0)
            if force_accum_single_gpu:
                steps = np.where((k_safe == 1) & (batch > self.init_batch), np.maximum(steps, 1.0), steps)
            if max_accum is not None:
                steps = np.minimum(steps, float(max_accum))
            per_gpu = np.ceil(local / (steps + 1.0))
        else:
            steps = np.zeros_like(local)
            per_gpu = np.ceil(local)
            if force_accum_single_gpu:
                per_gpu = np.where(k_safe == 1, self.init_batch, per_gpu)
        ok = valid & (per_gpu >= min_b) & (per_gpu <= max_b)
        return _Candidates(shape, n, k_safe, per_gpu, steps, ok, {})

    def _pick(self, c):
        """Goodput of every candidate (GOODPUT = THROUGHPUT x EFFICIENCY), then the best per allocation: one
        compiled call (:mod:`elasticlab.goodput._best`; :func:`_best_numpy` is its numpy
        reference, the same numbers)."""
        parts = c.by_model.get(self.model)  # THROUGHPUT and M of a cached grid do not depend on phi
        if parts is None:
            if len(c.by_model) >= 4:
                c.by_model.clear()
            parts = _throughput_parts(self.model, c.nodes, c.gpus, c.per_gpu, c.steps)
            parts = tuple(np.broadcast_to(a, c.per_gpu.shape) for a in parts)
            for a in parts:
                a.setflags(write=False)
            c.by_model[self.model] = parts
        if not c.shape:  # scalars in, scalars out
            g, b, s = _kernels()[1](parts[0], parts[1], c.per_gpu, c.steps, c.ok, self.phi, self.init_batch)
            return float(g), int(b), int(s)
        g, b, s = _kernels()[0](parts[0], parts[1], c.per_gpu, c.steps, c.ok, self.phi, self.init_batch)
        return g.reshape(c.shape), b.reshape(c.shape), s.reshape(c.shape)

    def speedup(self, nodes, gpus, *, base=(1, 1), **optimize_kw):
        """Pollux SPEEDUP: best goodput on (nodes, gpus) over best goodput on ``base`` = (nodes, gpus)."""
        g, _, _ = self.optimize(nodes, gpus, **optimize_kw)
        g0, _, _ = self.optimize(base[0], base[1], **optimize_kw)
        if g0 <= 0:
            raise ValueError(f"no feasible configuration on the base allocation {base}")
        return g / g0

    def speedup_table(self, max_nodes, gpus_per_node, *, base=(1, 1), **optimize_kw):
        """Speedups of every allocation, shape ``(max_nodes + 1, max_nodes * gpus_per_node + 1)``:
        entry ``[N, K]`` for N nodes holding K GPUs in all; 0 where ``K < N`` or ``K > N * gpus_per_node``
        (and at [0, 0]). One vectorised :meth:`optimize` over all valid pairs plus the base."""
        if int(max_nodes) < 1 or int(gpus_per_node) < 1:
            raise ValueError(f"need max_nodes >= 1 and gpus_per_node >= 1, got {max_nodes}, {gpus_per_node}")
        nn, kk, un, uk, inverse = _allocation_grid(int(max_nodes), int(gpus_per_node))
        # theta_sys sees nodes only through "more than one node", so (2, K) stands for every (N > 1, K);
        # the candidate grid does not depend on theta_sys or phi, so it is cached across calls
        kw = tuple(sorted((k, v if np.isscalar(v) or v is None else tuple(v))
                          for k, v in optimize_kw.items()))
        key = (int(max_nodes), int(gpus_per_node), tuple(base), self.init_batch, kw)
        cands = _CANDIDATE_CACHE.get(key)
        if cands is None:
            cands = self._candidates(np.append(un, base[0]), np.append(uk, base[1]), **optimize_kw)
            _keep_candidates(key, cands, 256)
        g, _, _ = self._pick(cands)
        if g[-1] <= 0:
            raise ValueError(f"no feasible configuration on the base allocation {base}")
        table = np.zeros((int(max_nodes) + 1, int(max_nodes) * int(gpus_per_node) + 1))
        table[nn, kk] = g[inverse] / g[-1]
        return table


class _Candidates(NamedTuple):
    shape: tuple
    nodes: np.ndarray  # (A, 1)
    gpus: np.ndarray  # (A, 1)
    per_gpu: np.ndarray  # (A, C)
    steps: np.ndarray  # (A, C)
    ok: np.ndarray  # (A, C) feasible
    by_model: dict  # ThroughputModel -> (THROUGHPUT, M) over the grid: the part of goodput phi does not enter


def _best_numpy(throughput, batch, per_gpu, steps, ok, phi, init_batch):
    """The numpy form of :func:`elasticlab.goodput._best.best_candidates` (its reference in the tests):
    GOODPUT of each feasible candidate (-inf elsewhere), np.argmax per row, (0, 0, 0) where not finite."""
    good = _times_efficiency(throughput, batch, phi, init_batch)
    good[~ok] = -np.inf
    best = np.argmax(good, axis=1)
    rows = np.arange(len(best))
    g, b, s = good[rows, best], per_gpu[rows, best], steps[rows, best]
    feasible = np.isfinite(g)
    return (np.where(feasible, g, 0.0), np.where(feasible, b, 0).astype(np.int64),
            np.where(feasible, s, 0).astype(np.int64))


_KERNELS = []


def _kernels():
    """``(best_candidates, best_candidate)`` of :mod:`elasticlab.goodput._best`, imported on first use
    (numba is slow to import)."""
    if not _KERNELS:
        from elasticlab.goodput._best import best_candidate, best_candidates

        _KERNELS.extend((best_candidates, best_candidate))
    return _KERNELS


_GRID_CACHE: dict = {}
_CANDIDATE_CACHE: dict = {}


def _keep_candidates(key, cands: _Candidates, limit: int) -> None:
    """Caches a candidate grid under ``key``, its arrays read-only (the cache is emptied once it holds more
    than ``limit`` grids)."""
    for a in (cands.nodes, cands.gpus, cands.per_gpu, cands.steps, cands.ok):
        a.setflags(write=False)
    if len(_CANDIDATE_CACHE) > limit:
        _CANDIDATE_CACHE.clear()
    _CANDIDATE_CACHE[key] = cands


def _optimize_key(init_batch, nodes, gpus, kw):
    """The cache key of :meth:`GoodputFunction.optimize`'s candidate grid: every input it depends on, or
    None where one is not hashable (no caching then; the grid is built, and checked, as usual). Python
    numbers get the key their 0-d arrays get, without building the arrays (the simulator's scalar calls)."""
    rest = tuple(kw.values())
    try:
        hash(rest)
    except TypeError:
        rest = tuple(tuple(v) if isinstance(v, (list, tuple, np.ndarray)) else v for v in kw.values())
    try:
        if type(nodes) in _NUMBER and type(gpus) in _NUMBER:
            key = ("optimize", init_batch, (), _DOUBLE(float(nodes)), (), _DOUBLE(float(gpus)), rest)
        else:
            n, k = np.asarray(nodes, dtype=float), np.asarray(gpus, dtype=float)
            key = ("optimize", init_batch, n.shape, n.tobytes(), k.shape, k.tobytes(), rest)
        hash(key)
    except (TypeError, ValueError, OverflowError):
        return None
    return key


_NUMBER = (int, float)
_DOUBLE = struct.Struct("=d").pack  # the bytes of a float64 in native order, as ndarray.tobytes() gives


def _allocation_grid(max_nodes, gpus_per_node):
    """Valid (N, K) pairs of a cluster, and their distinct (min(N, 2), K) classes with the inverse map."""
    key = (max_nodes, gpus_per_node)
    if key not in _GRID_CACHE:
        nn = np.concatenate([np.full(n * gpus_per_node - n + 1, n) for n in range(1, max_nodes + 1)])
        kk = np.concatenate([np.arange(n, n * gpus_per_node + 1) for n in range(1, max_nodes + 1)])
        pairs, inverse = np.unique(np.stack([np.minimum(nn, 2), kk], axis=1), axis=0, return_inverse=True)
        _GRID_CACHE[key] = (nn, kk, pairs[:, 0], pairs[:, 1], inverse.ravel())
    return _GRID_CACHE[key]
