"""Pollux's goodput model (Qiao et al., OSDI 2021): throughput x statistical efficiency.

Everything here is vectorised numpy: the allocator evaluates thousands of (nodes, GPUs) candidates per
round. Notation: ``M0`` initial global batch, ``M`` global batch per optimizer step, ``K`` GPUs (replicas),
``N`` nodes, ``b`` per-GPU micro-batch, ``s`` accumulation steps, so ``M = K * b * (s + 1)``.

- :func:`efficiency` -- Pollux's EFFICIENCY_t, ``E(M) = (phi + M0) / (phi + M)``;
- :class:`ThroughputModel` -- Pollux's THROUGHPUT (T_grad, T_sync, T_iter), seven parameters ``theta_sys``;
- :func:`fit_throughput_model` -- RMSLE fit under bounds (L-BFGS-B) with the prior-driven pinning of
  parameters that the observations cannot identify yet (Pollux's prior-driven exploration);
- :class:`GoodputFunction` -- goodput, the agent's ``(b, s)`` choice, and speedups for the scheduler;
- :func:`fitness` -- the scheduler's power-mean objective FITNESS_p, :func:`restart_penalty`.

Formulas as restated in shared/reference/papers.md (P4) and pollux-artifact.md §1.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from numbers import Real
from typing import NamedTuple

import numpy as np

__all__ = [
    "GradParams",
    "ThroughputModel",
    "GoodputFunction",
    "efficiency",
    "gain",
    "noise_scale",
    "fit_throughput_model",
    "fitness",
    "restart_penalty",
    "OBSERVATION_COLUMNS",
]

OBSERVATION_COLUMNS = ("nodes", "gpus", "per_gpu_batch", "accum_steps", "iter_time", "sync_time")
_LOWER = 1e-8  # lower bound of every alpha/beta (the artifact's), gamma lives in [1, 10]
_GAMMA_MAX = 10.0


# ------------------------------------------------------------------------------------------------
# statistical efficiency


def efficiency(phi, m0, m):
    """Pollux EFFICIENCY_t: ``E(M) = (phi + M0) / (phi + M)``, vectorised over ``phi`` and ``m``.

    ``phi`` is the (pre-conditioned) gradient noise scale tr(Sigma)/|G|^2 (McCandlish's B_simple);
    ``phi = inf`` (pure noise) gives 1 for every M. E(M0) = 1 and E < 1 for M > M0.
    """
    phi = np.asarray(phi, dtype=float)
    m = np.asarray(m, dtype=float)
    if np.any(phi < 0) or np.any(np.isnan(phi)):
        raise ValueError(f"phi (gradient noise scale) must be >= 0, got {phi}")
    _check_positive("m0 (initial batch size)", m0)
    _check_positive("m (batch size)", m)
    # written as 1 - (M - M0) / (phi + M) so that phi = inf gives exactly 1
    out = 1.0 - (m - m0) / (phi + m)
    return out if out.ndim else float(out)


def gain(phi, m0, m):
    """AdaScale's gain ratio r at scale S = M/M0 (Johnson et al. 2020), = S * E(M) in Pollux's terms."""
    return efficiency(phi, m0, m) * (np.asarray(m, dtype=float) / m0)


class GradParams(NamedTuple):
    """Pollux's gradient statistics: ``sqr`` ~ |G|^2 and ``var`` ~ tr(Sigma)/M0 (the variance at the
    initial batch), so phi = M0 * var / sqr."""

    sqr: float
    var: float

    @classmethod
    def from_gns(cls, phi, init_batch) -> GradParams:
        """The (sqr, var) pair with |G|^2 = 1 that has noise scale ``phi`` at initial batch ``init_batch``."""
        phi = noise_scale(phi)
        _check_positive("init_batch", init_batch)
        return cls(1.0, phi / float(init_batch))


def noise_scale(stats, init_batch=None) -> float:
    """The gradient noise scale phi = tr(Sigma)/|G|^2 from whatever the caller holds.

    Accepts a number (phi itself, must be >= 0), a pair ``(sqr, var)`` in Pollux's convention
    (``var`` = gradient variance at the initial batch, so phi = M0 * var / sqr), or an object with, in
    order of preference, ``b_simple``; ``grad_sq`` and ``trace_cov``; or ``sqr`` and ``var``
    (e.g. :class:`elasticlab.gns.GNSEstimator`). Estimates are clipped like Pollux's readout
    (|G|^2 >= 0, variance >= 0), so a noisy negative estimate gives phi = 0 or inf, never an error.
    """
    if isinstance(stats, Real) or (isinstance(stats, np.ndarray) and stats.ndim == 0):
        phi = float(stats)
        if not phi >= 0:
            raise ValueError(f"phi (gradient noise scale) must be >= 0, got {phi}")
        return phi
    if isinstance(stats, tuple) and len(stats) == 2:
        return _phi_from_sqr_var(stats[0], stats[1], init_batch)
    b_simple = _attr(stats, "b_simple")
    if b_simple is not None:
        return max(float(b_simple), 0.0) if not math.isnan(float(b_simple)) else _nan_stats(stats)
    grad_sq, trace_cov = _attr(stats, "grad_sq"), _attr(stats, "trace_cov")
    if grad_sq is not None and trace_cov is not None:
        return _ratio(max(float(trace_cov), 0.0), max(float(grad_sq), 0.0))
    sqr, var = _attr(stats, "sqr"), _attr(stats, "var")
    if sqr is not None and var is not None:
        return _phi_from_sqr_var(sqr, var, init_batch)
    raise TypeError(
        f"cannot read a gradient noise scale from {stats!r}: pass phi, (sqr, var), or an object with "
        "b_simple, grad_sq/trace_cov or sqr/var"
    )


def _attr(obj, name):
    value = getattr(obj, name, None)
    if callable(value):
        value = value()
    if value is None:
        return None
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    return float(value)


def _phi_from_sqr_var(sqr, var, init_batch):
    if init_batch is None:
        raise ValueError("(sqr, var) statistics need init_batch: var is the variance at the initial batch")
    sqr, var = float(sqr), float(var)
    if math.isnan(sqr) or math.isnan(var):
        raise ValueError(f"gradient statistics are NaN: sqr={sqr}, var={var}")
    return _ratio(float(init_batch) * max(var, 0.0), max(sqr, 0.0))


def _ratio(num, den):
    if den > 0:
        return num / den
    return math.inf if num > 0 else 0.0


def _nan_stats(stats):
    raise ValueError(f"gradient statistics of {stats!r} are NaN")


def _check_positive(name, value):
    arr = np.asarray(value, dtype=float)
    if np.any(~(arr > 0)):
        raise ValueError(f"{name} must be > 0, got {value}")


# ------------------------------------------------------------------------------------------------
# throughput model


@dataclass(frozen=True)
class ThroughputModel:
    """Pollux's throughput model theta_sys; times in seconds, batches in samples.

    ``T_grad(b) = alpha_grad + beta_grad * b`` (one forward/backward of a micro-batch);
    ``T_sync`` = 0 on one GPU, ``alpha_local + beta_local * (K - 2)`` on one node, else
    ``alpha_node + beta_node * (K - 2)``; an optimizer step overlaps them,
    ``T_step = (T_grad^gamma + T_sync^gamma)^(1/gamma)`` (gamma = 1: no overlap, gamma -> inf: max);
    ``T_iter = s * T_grad + T_step`` (accumulation micro-steps do not sync).
    """

    alpha_grad: float
    beta_grad: float
    alpha_local: float = 0.0
    beta_local: float = 0.0
    alpha_node: float = 0.0
    beta_node: float = 0.0
    gamma: float = 1.0

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, Real) or not math.isfinite(v):
                raise ValueError(f"ThroughputModel.{f.name} must be a finite number, got {v!r}")
            if f.name != "gamma" and v < 0:
                raise ValueError(f"ThroughputModel.{f.name} must be >= 0 (a time), got {v}")
        if not 1.0 <= self.gamma:
            raise ValueError(f"ThroughputModel.gamma must be >= 1, got {self.gamma}")

    def to_array(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=float)

    @classmethod
    def from_array(cls, x) -> ThroughputModel:
        return cls(*(float(v) for v in np.asarray(x, dtype=float).ravel()))

    def as_dict(self) -> dict:
        return asdict(self)

    def grad_time(self, per_gpu_batch):
        """T_grad(b) = alpha_grad + beta_grad * b."""
        return self.alpha_grad + self.beta_grad * np.asarray(per_gpu_batch, dtype=float)

    def sync_time(self, nodes, gpus):
        """T_sync(N, K), by the slowest link the job spans."""
        nodes = np.asarray(nodes, dtype=float)
        gpus = np.asarray(gpus, dtype=float)
        extra = np.maximum(gpus - 2.0, 0.0)
        t = np.where(nodes > 1, self.alpha_node + self.beta_node * extra,
                     self.alpha_local + self.beta_local * extra)
        return np.where(gpus > 1, t, 0.0)

    def step_time(self, nodes, gpus, per_gpu_batch):
        """T_iter without accumulation: the overlapped optimizer step."""
        return _overlap(self.grad_time(per_gpu_batch), self.sync_time(nodes, gpus), self.gamma)

    def iter_time(self, nodes, gpus, per_gpu_batch, accum_steps=0):
        """``T_iter = s * T_grad + T_step``, broadcast over all arguments."""
        t_grad = self.grad_time(per_gpu_batch)
        t_step = _overlap(t_grad, self.sync_time(nodes, gpus), self.gamma)
        return np.asarray(accum_steps, dtype=float) * t_grad + t_step

    def throughput(self, nodes, gpus, per_gpu_batch, accum_steps=0):
        """Samples per second, ``M / T_iter``."""
        gpus = np.asarray(gpus, dtype=float)
        b = np.asarray(per_gpu_batch, dtype=float)
        s = np.asarray(accum_steps, dtype=float)
        return gpus * b * (s + 1.0) / self.iter_time(nodes, gpus, b, s)


def _overlap(t_grad, t_sync, gamma):
    """``(a^g + c^g)^(1/g)`` computed as ``m * ((a/m)^g + (c/m)^g)^(1/g)``, m = max(a, c), to avoid
    underflow for small times and large gamma."""
    if gamma == 1.0:
        return t_grad + t_sync
    hi = np.maximum(t_grad, t_sync)
    lo = np.minimum(t_grad, t_sync)
    safe = np.where(hi > 0, hi, 1.0)
    return hi * (1.0 + (lo / safe) ** gamma) ** (1.0 / gamma)


# ------------------------------------------------------------------------------------------------
# fitting


def _as_observations(observations) -> np.ndarray:
    """Rows ``(nodes, gpus, per_gpu_batch, accum_steps, iter_time[, sync_time])`` -> (n, 6) float array
    (sync_time NaN where not measured). Accepts a sequence of rows, an array or a pandas DataFrame with
    those column names."""
    if hasattr(observations, "columns"):  # pandas DataFrame
        missing = [c for c in OBSERVATION_COLUMNS[:5] if c not in observations.columns]
        if missing:
            raise ValueError(f"observations lack columns {missing}; need {OBSERVATION_COLUMNS}")
        cols = [c for c in OBSERVATION_COLUMNS if c in observations.columns]
        observations = observations[cols].to_numpy(dtype=float)
    rows = [observations] if isinstance(observations, np.ndarray) else list(observations)
    if len(rows) == 0 or (isinstance(observations, np.ndarray) and observations.size == 0):
        raise ValueError("cannot fit a throughput model to an empty set of observations")
    if isinstance(observations, np.ndarray):
        obs = np.atleast_2d(np.asarray(observations, dtype=float))
    else:
        width = {len(r) for r in rows}
        if not width <= {5, 6}:
            raise ValueError(f"each observation must have 5 or 6 fields {OBSERVATION_COLUMNS}, got {width}")
        obs = np.array([list(r) + [np.nan] * (6 - len(r)) for r in rows], dtype=float)
    if obs.shape[1] == 5:
        obs = np.column_stack([obs, np.full(len(obs), np.nan)])
    if obs.ndim != 2 or obs.shape[1] != 6:
        raise ValueError(f"observations must have 5 or 6 columns {OBSERVATION_COLUMNS}, got {obs.shape}")
    nodes, gpus, b, s, t, sync = obs.T
    for name, col, ok in (
        ("nodes", nodes, nodes >= 1),
        ("gpus", gpus, gpus >= nodes),
        ("per_gpu_batch", b, b >= 1),
        ("accum_steps", s, s >= 0),
        ("iter_time", t, (t > 0) & np.isfinite(t)),
        ("sync_time", sync, np.isnan(sync) | ((sync >= 0) & (sync < t))),
    ):
        if not np.all(ok):
            i = int(np.argmin(ok))
            raise ValueError(
                f"observation {i} has a bad {name} = {float(col[i])!r} (row {obs[i].tolist()}): need "
                "nodes >= 1, gpus >= nodes, per_gpu_batch >= 1, accum_steps >= 0, iter_time > 0, "
                "0 <= sync_time < iter_time"
            )
    return obs


def _predict(theta, nodes, gpus, b, s):
    """Predictions and their derivatives w.r.t. theta (7 raw parameters), for the analytic gradient."""
    ag, bg, al, bl, an, bn, g = theta
    extra = np.maximum(gpus - 2.0, 0.0)
    multi = nodes > 1
    synced = gpus > 1
    t_grad = ag + bg * b
    t_sync = np.where(synced, np.where(multi, an + bn * extra, al + bl * extra), 0.0)
    hi = np.maximum(t_grad, t_sync)
    ra, rc = t_grad / hi, t_sync / hi
    u = ra**g + rc**g
    t_step = hi * u ** (1.0 / g)
    # dT_step/dT_grad = (T_grad/T_step)^(g-1), same for T_sync; d log T_step / d g
    d_grad = (t_grad / t_step) ** (g - 1.0)
    d_sync = np.where(synced, (t_sync / t_step) ** (g - 1.0), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        la = np.where(ra > 0, ra**g * np.log(np.where(ra > 0, ra, 1.0)), 0.0)
        lc = np.where(rc > 0, rc**g * np.log(np.where(rc > 0, rc, 1.0)), 0.0)
    d_gamma = t_step * (-np.log(u) / g**2 + (la + lc) / (g * u))
    t_iter = s * t_grad + t_step
    one = np.ones_like(b)
    # Jacobians (rows: observations, columns: theta)
    j_grad = np.stack([one, b, 0 * b, 0 * b, 0 * b, 0 * b, 0 * b], axis=1)
    loc = synced & ~multi
    rem = synced & multi
    j_sync = np.stack([0 * b, 0 * b, loc * one, loc * extra, rem * one, rem * extra, 0 * b], axis=1)
    j_iter = (s + d_grad)[:, None] * j_grad + d_sync[:, None] * j_sync
    j_iter[:, 6] = d_gamma
    return t_iter, j_iter, t_grad, j_grad, t_sync, j_sync


def _rmsle(pred, jac, obs):
    """sqrt(mean((log pred - log obs)^2)) and its gradient."""
    e = np.log(pred) - np.log(obs)
    r = math.sqrt(float(np.mean(e * e)))
    if r == 0.0:
        return 0.0, np.zeros(jac.shape[1])
    return r, (e / pred) @ jac / (len(e) * r)


def _objective(x, log_mask, nodes, gpus, b, s, t, grad_obs, has_grad, sync, has_sync):
    theta = np.where(log_mask, np.exp(x), x)
    t_iter, j_iter, t_grad, j_grad, t_sync, j_sync = _predict(theta, nodes, gpus, b, s)
    loss, grad = _rmsle(t_iter, j_iter, t)
    if has_grad.any():
        l2, g2 = _rmsle(t_grad[has_grad], j_grad[has_grad], grad_obs[has_grad])
        loss, grad = loss + l2, grad + g2
    if has_sync.any():
        l3, g3 = _rmsle(t_sync[has_sync], j_sync[has_sync], sync[has_sync])
        loss, grad = loss + l3, grad + g3
    grad = np.where(log_mask, grad * theta, grad)  # chain rule for log-parameterised entries
    # the artifact's regularisers: prefer little overlap, optimistic (small) retrogression beta/alpha;
    # d(beta/alpha)^2 / d log beta = -d / d log alpha = 2 (beta/alpha)^2
    ag, bg, al, bl, an, bn, g = theta
    with np.errstate(over="ignore"):
        rn, rl = (bn / an) ** 2, (bl / al) ** 2
    loss += 1e-3 * (g - 1.0) ** 2 + 1e-2 * (rn + rl)
    grad[6] += 2e-3 * (g - 1.0)
    grad[5] += 2e-2 * rn
    grad[4] -= 2e-2 * rn
    grad[3] += 2e-2 * rl
    grad[2] -= 2e-2 * rl
    return loss, grad


def _one_blas_thread():
    """L-BFGS-B calls BLAS on 7x7 matrices; a multi-threaded OpenBLAS makes each iteration ~10x slower
    on a loaded machine, so the fit runs with one BLAS thread."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
        from contextlib import nullcontext

        return nullcontext()
    return threadpool_limits(1, user_api="blas")


def fit_throughput_model(observations, prior="pollux", init=None, node_slowdown=1.1) -> ThroughputModel:
    """Fit theta_sys to observed step times by RMSLE under bounds (scipy L-BFGS-B), as Pollux does.

    ``observations``: rows ``(nodes, gpus, per_gpu_batch, accum_steps, iter_time[, sync_time])`` (or an
    (n, 5|6) array, or a DataFrame with those columns). ``iter_time`` is one optimizer step including its
    accumulation micro-steps; ``sync_time`` (optional, NaN where unknown) is the all-reduce part. With
    sync times the per-micro-batch compute ``(iter_time - sync_time) / (s + 1)`` and the sync time are
    fitted too, as the artifact does.

    ``prior="pollux"`` pins what the data cannot identify yet (Pollux's prior-driven exploration):
    one per-GPU batch size seen -> ``alpha_grad`` = half the compute time; no multi-GPU single-node data ->
    ``alpha_local, beta_local`` = 0; no multi-node data -> ``alpha_node, beta_node`` at least
    ``node_slowdown`` x the local ones; nothing above 2 GPUs -> the betas = 0. ``prior=None`` fits all seven.
    ``init``: a ThroughputModel to start from (default: the artifact's start, 0.1 / 0.01 / gamma 1.001).
    """
    from scipy.optimize import minimize

    if prior not in ("pollux", None):
        raise ValueError(f"prior must be 'pollux' or None, got {prior!r}")
    obs = _as_observations(observations)
    nodes, gpus, b, s, t, sync = obs.T
    has_sync = ~np.isnan(sync) & (gpus > 1) & (sync > 0)
    has_grad = ~np.isnan(sync)
    grad_obs = np.where(has_grad, (t - np.nan_to_num(sync)) / (s + 1.0), 1.0)
    has_grad &= grad_obs > 0

    x0 = init.to_array() if init is not None else np.array([0.1, 0.01, 0.1, 0.01, 0.1, 0.01, 1.001])
    x0 = np.clip(x0, _LOWER, None)
    x0[6] = min(max(x0[6], 1.0), _GAMMA_MAX)
    lower = np.array([_LOWER] * 6 + [1.0])
    upper = np.array([np.inf] * 6 + [_GAMMA_MAX])
    pinned = {}
    if prior == "pollux":
        if len(np.unique(b)) == 1:
            compute = np.where(has_grad, grad_obs, t / (s + 1.0))
            pinned[0] = float(np.mean(compute)) / 2.0
        single_node_multi = (nodes == 1) & (gpus > 1)
        if not single_node_multi.any():
            pinned[2] = pinned[3] = _LOWER
        if not (nodes > 1).any():
            pinned[4] = pinned[5] = _LOWER
        if not (gpus > 2).any():
            pinned[3] = pinned[5] = _LOWER
    for i, v in pinned.items():
        x0[i] = lower[i] = upper[i] = v

    log_mask = np.array([True] * 6 + [False])
    lo = np.where(log_mask, np.log(lower), lower)
    hi = np.where(log_mask, np.log(np.where(np.isinf(upper), 1.0, upper)), upper)
    bounds = [
        (lo[i], None if (log_mask[i] and np.isinf(upper[i])) else hi[i]) for i in range(7)
    ]
    args = (log_mask, nodes, gpus, b, s, t, grad_obs, has_grad, sync, has_sync)
    best = None
    with _one_blas_thread():
        for g0 in (x0[6], 3.0):  # two starts in gamma: the objective is not convex in it
            start = np.where(log_mask, np.log(x0), x0)
            start[6] = g0 if 6 not in pinned else x0[6]
            res = minimize(_objective, start, args=args, jac=True, method="L-BFGS-B", bounds=bounds)
            if best is None or res.fun < best.fun:
                best = res
    theta = np.where(log_mask, np.exp(best.x), best.x)
    for i, v in pinned.items():
        theta[i] = v
    theta[6] = min(max(theta[6], 1.0), _GAMMA_MAX)
    if prior == "pollux" and not (nodes > 1).any():
        # inter-node links are assumed slower than intra-node ones until measured
        theta[4] = max(theta[4], node_slowdown * theta[2])
        theta[5] = max(theta[5], node_slowdown * theta[3])
    return ThroughputModel.from_array(theta)


# ------------------------------------------------------------------------------------------------
# goodput


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
        gpus = np.asarray(gpus, dtype=float)
        b = np.asarray(per_gpu_batch, dtype=float)
        s = np.asarray(accum_steps, dtype=float)
        batch = gpus * b * (s + 1.0)
        t = self.model.iter_time(nodes, gpus, b, s)
        return batch / t * (1.0 - (batch - self.init_batch) / (self.phi + batch))

    def _batch_range(self, max_batch, batch_range):
        m0 = self.init_batch
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
        cands = self._candidates(nodes, gpus, max_batch=max_batch, batch_range=batch_range,
                                 max_per_gpu_batch=max_per_gpu_batch, min_per_gpu_batch=min_per_gpu_batch,
                                 max_accum=max_accum, accumulation=accumulation,
                                 num_candidates=num_candidates, force_accum_single_gpu=force_accum_single_gpu,
                                 max_batch_size=max_batch_size, atomic_bsz_range=atomic_bsz_range)
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
        total = k_safe * per_gpu * (steps + 1.0)
        return _Candidates(shape, n, k_safe, per_gpu, steps, total, ok)

    def _pick(self, c):
        """Goodput of every candidate (GOODPUT = THROUGHPUT x EFFICIENCY), then the best per allocation."""
        m = self.model
        t_grad = m.alpha_grad + m.beta_grad * c.per_gpu
        t_iter = c.steps * t_grad + _overlap(t_grad, m.sync_time(c.nodes, c.gpus), m.gamma)
        good = c.total / t_iter * (1.0 - (c.total - self.init_batch) / (self.phi + c.total))
        good[~c.ok] = -np.inf
        best = np.argmax(good, axis=1)
        rows = np.arange(len(best))
        g, b, s = good[rows, best], c.per_gpu[rows, best], c.steps[rows, best]
        feasible = np.isfinite(g)
        g = np.where(feasible, g, 0.0).reshape(c.shape)
        b = np.where(feasible, b, 0).astype(np.int64).reshape(c.shape)
        s = np.where(feasible, s, 0).astype(np.int64).reshape(c.shape)
        if not c.shape:
            return float(g), int(b), int(s)
        return g, b, s

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
            if len(_CANDIDATE_CACHE) > 256:
                _CANDIDATE_CACHE.clear()
            _CANDIDATE_CACHE[key] = cands
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
    total: np.ndarray  # (A, C) global batch K * b * (s + 1)
    ok: np.ndarray  # (A, C) feasible


_GRID_CACHE: dict = {}
_CANDIDATE_CACHE: dict = {}


def _allocation_grid(max_nodes, gpus_per_node):
    """Valid (N, K) pairs of a cluster, and their distinct (min(N, 2), K) classes with the inverse map."""
    key = (max_nodes, gpus_per_node)
    if key not in _GRID_CACHE:
        nn = np.concatenate([np.full(n * gpus_per_node - n + 1, n) for n in range(1, max_nodes + 1)])
        kk = np.concatenate([np.arange(n, n * gpus_per_node + 1) for n in range(1, max_nodes + 1)])
        pairs, inverse = np.unique(np.stack([np.minimum(nn, 2), kk], axis=1), axis=0, return_inverse=True)
        _GRID_CACHE[key] = (nn, kk, pairs[:, 0], pairs[:, 1], inverse.ravel())
    return _GRID_CACHE[key]


# ------------------------------------------------------------------------------------------------
# scheduler objective


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
    """Pollux's re-allocation penalty ``max(T - R * delta, 0) / (T + delta)`` on a job's speedup."""
    age = np.asarray(age, dtype=float)
    restarts = np.asarray(restarts, dtype=float)
    if np.any(age < 0) or np.any(restarts < 0) or delay < 0:
        raise ValueError(f"age, restarts and delay must be >= 0, got {age}, {restarts}, {delay}")
    return np.maximum(age - restarts * delay, 0.0) / (age + delay)
