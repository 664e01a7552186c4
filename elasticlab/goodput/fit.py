"""Fitting Pollux's throughput model theta_sys to observed step times (Qiao et al., OSDI 2021, §4.1).

RMSLE under bounds (scipy L-BFGS-B, analytic gradient) with the artifact's regularisers and the prior-driven
pinning of the parameters that the observations cannot identify yet (Pollux's prior-driven exploration).
The prediction uses the formulas of :mod:`elasticlab.goodput.throughput`; only their derivatives live here.
"""
from __future__ import annotations

import math

import numpy as np

from elasticlab.goodput.throughput import (
    ThroughputModel,
    _grad_time,
    _iter_time,
    _sync_terms,
    _sync_time,
)

__all__ = ["OBSERVATION_COLUMNS", "fit_throughput_model"]

OBSERVATION_COLUMNS = ("nodes", "gpus", "per_gpu_batch", "accum_steps", "iter_time", "sync_time")
_LOWER = 1e-8  # lower bound of every alpha/beta (the artifact's), gamma lives in [1, 10]
_GAMMA_MAX = 10.0

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
    if isinstance(observations, (str, bytes)) or not hasattr(observations, "__iter__"):
        raise ValueError(f"observations must be rows {OBSERVATION_COLUMNS} (a sequence, an array or a "
                         f"DataFrame), got {type(observations).__name__} {observations!r:.60}")
    rows = [observations] if isinstance(observations, np.ndarray) else list(observations)
    if len(rows) == 0 or (isinstance(observations, np.ndarray) and observations.size == 0):
        raise ValueError("cannot fit a throughput model to an empty set of observations")
    if isinstance(observations, np.ndarray):
        obs = np.atleast_2d(np.asarray(observations, dtype=float))
    else:
        for i, r in enumerate(rows):
            if isinstance(r, (str, bytes)) or not hasattr(r, "__len__") or len(r) not in (5, 6):
                raise ValueError(f"observation {i} must be a row of 5 or 6 numbers {OBSERVATION_COLUMNS}, "
                                 f"got {r!r:.80}")
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
    extra, multi, synced = _sync_terms(nodes, gpus)
    t_grad = _grad_time(ag, bg, b)
    t_sync = _sync_time(al, bl, an, bn, nodes, gpus)
    # T_step of throughput._overlap, in the form its derivatives below need (hi > 0: alpha_grad >= _LOWER);
    # bit for bit _overlap's value except at gamma = 1, where _overlap adds (the fits keep this form)
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
    t_iter = _iter_time(t_grad, t_step, s)
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
