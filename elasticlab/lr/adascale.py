"""AdaScale SGD (Johnson et al., ICML 2020): the gain ratio, its estimator, and the LR rule.

``r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2)``, sigma^2 = tr(Sigma) of one base-batch gradient,
mu^2 = |grad F|^2. In noise-scale form (phi = B_simple, M0 = base batch) ``r = (1 + phi/M0) /
(1 + phi/(S M0))``, so Pollux's efficiency is ``r / S`` (papers.md, cross-paper links).
"""
from __future__ import annotations

import math

import numpy as np

from elasticlab.checks import number

from ..goodput import noise_scale
from .base import check_scale, register


def gain_ratio(sigma2, mu2, scale):
    """AdaScale's gain ratio, vectorised: ``(sigma2 + mu2) / (sigma2 / S + mu2)``, in [1, S] for S >= 1."""
    sigma2 = np.asarray(sigma2, dtype=float)
    mu2 = np.asarray(mu2, dtype=float)
    scale = np.asarray(scale, dtype=float)
    if np.any(sigma2 < 0) or np.any(mu2 < 0) or np.any(np.isnan(sigma2)) or np.any(np.isnan(mu2)):
        raise ValueError(f"sigma2 and mu2 must be >= 0, got sigma2={sigma2}, mu2={mu2}")
    if np.any(~(scale > 0)):
        raise ValueError(f"scale S must be > 0, got {scale}")
    den = sigma2 / scale + mu2
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(den > 0, (sigma2 + mu2) / np.where(den > 0, den, 1.0), 1.0)
    return r if r.ndim else float(r)


def gain_from_noise_scale(phi, init_batch, scale):
    """``r(S)`` from phi = tr(Sigma)/|G|^2 and the base batch M0; phi = inf gives r = S."""
    phi = float(phi)
    scale = check_scale(scale)
    if math.isinf(phi):
        return scale
    ratio = phi / float(init_batch)  # sigma^2 / mu^2
    return (ratio + 1.0) / (ratio / scale + 1.0)


def adascale_moments(worker_grads):
    """AdaScale's unbiased estimates ``(sigma2, mu2)`` from S >= 2 independent worker gradients.

    ``worker_grads``: array or tensor of shape (S, ...) (or a list of S same-shaped ones);
    ``sigma2 = 1/(S-1) sum_i |g_i|^2 - S/(S-1) |g_bar|^2``, ``mu2 = |g_bar|^2 - sigma2 / S``.
    """
    g = _as_2d(worker_grads)
    s = g.shape[0]
    if s < 2:
        raise ValueError(f"need gradients from at least 2 workers to estimate the variance, got {s}")
    mean_sq = float((g.sum(0) / s).pow(2).sum()) if hasattr(g, "pow") else float(np.sum(g.mean(0) ** 2))
    sum_sq = float(g.pow(2).sum()) if hasattr(g, "pow") else float(np.sum(g * g))
    return adascale_moments_from_norms(sum_sq, mean_sq, s)


def adascale_moments_from_norms(sum_sq, mean_sq, workers):
    """The same estimates from ``sum_i |g_i|^2`` and ``|g_bar|^2`` over ``workers`` gradients."""
    s = int(workers)
    if s < 2:
        raise ValueError(f"need gradients from at least 2 workers to estimate the variance, got {s}")
    sigma2 = float(sum_sq) / (s - 1) - s / (s - 1) * float(mean_sq)
    return sigma2, float(mean_sq) - sigma2 / s


def _as_2d(worker_grads):
    if isinstance(worker_grads, (list, tuple)):
        first = worker_grads[0]
        if hasattr(first, "reshape") and hasattr(first, "pow"):  # torch
            import torch

            return torch.stack([w.reshape(-1) for w in worker_grads]).double()
        return np.stack([np.asarray(w, dtype=float).ravel() for w in worker_grads])
    if hasattr(worker_grads, "pow"):
        return worker_grads.reshape(worker_grads.shape[0], -1).double()
    arr = np.asarray(worker_grads, dtype=float)
    if arr.ndim < 1:
        raise ValueError(f"worker_grads must have a leading worker axis, got shape {arr.shape}")
    return arr.reshape(arr.shape[0], -1)


class AdaScaleEstimator:
    """AdaScale's smoothed (sigma2, mu2): EMAs with theta = max(1 - S/1000, 0), plain means for the
    first 1/(1 - theta) updates, readout clipped to sigma2 >= 1e-6, mu2 >= 0 (as AdaScale does).

    Exposes ``sqr`` / ``var`` (Pollux names, var at the base batch) and ``b_simple`` so it plugs into
    :class:`AdaScale` and :class:`elasticlab.goodput.GoodputFunction` like a GNS estimator.
    """

    def __init__(self, base_batch: float):
        self.base_batch = number("base_batch", base_batch, lambda b: b > 0, "a finite number > 0")
        self.sigma2_avg = 0.0
        self.mu2_avg = 0.0
        self.updates = 0

    def update(self, worker_grads) -> None:
        sigma2, mu2 = adascale_moments(worker_grads)
        self.update_moments(sigma2, mu2, scale=_as_2d(worker_grads).shape[0])

    def update_moments(self, sigma2: float, mu2: float, scale: float) -> None:
        if not (math.isfinite(sigma2) and math.isfinite(mu2)):
            return
        theta = max(1.0 - scale / 1000.0, 0.0)
        self.updates += 1
        w = 1.0 / self.updates if self.updates < 1.0 / (1.0 - theta) else 1.0 - theta
        self.sigma2_avg += w * (sigma2 - self.sigma2_avg)
        self.mu2_avg += w * (mu2 - self.mu2_avg)

    @property
    def var(self):
        return max(self.sigma2_avg, 1e-6) if self.updates else None

    @property
    def sqr(self):
        return max(self.mu2_avg, 0.0) if self.updates else None

    @property
    def b_simple(self):
        if not self.updates:
            return None
        return noise_scale((self.sqr, self.var), self.base_batch)

    def state_dict(self) -> dict:
        return {"base_batch": self.base_batch, "sigma2_avg": self.sigma2_avg, "mu2_avg": self.mu2_avg,
                "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.base_batch = float(state["base_batch"])
        self.sigma2_avg = float(state["sigma2_avg"])
        self.mu2_avg = float(state["mu2_avg"])
        self.updates = int(state["updates"])


@register("adascale", label="AdaScale (Johnson et al. 2020)", needs_gns=True, order=30)
class AdaScale:
    """LR multiplier ``r(S)^power`` from live gradient statistics (power 1: AdaScale for SGD; 0.5:
    AdaptDL's AdamScale for Adam). ``stats``: phi, ``(sqr, var)``, an object with ``b_simple`` /
    ``grad_sq`` + ``trace_cov`` / ``sqr`` + ``var`` (read at every call), or a zero-argument callable
    returning one. No statistics yet (None / NaN) -> r = 1, as AdaScale starts. ``init_batch`` is M0
    (the wrapper fills it in)."""

    def __init__(self, stats=None, init_batch: float | None = None, power: float = 1.0):
        self.power = number("power", power, lambda p: p > 0, "a finite number > 0")
        self.stats = stats
        self.init_batch = init_batch

    def phi(self):
        stats = self.stats() if callable(self.stats) and not hasattr(self.stats, "b_simple") else self.stats
        if stats is None:
            return None
        try:
            phi = noise_scale(stats, self.init_batch)
        except (TypeError, ValueError):
            return None  # no usable statistics yet
        return None if math.isnan(phi) else phi

    def gain(self, scale: float) -> float:
        scale = check_scale(scale)
        phi = self.phi()
        if phi is None or scale == 1.0:
            return 1.0
        if self.init_batch is None:
            raise ValueError("AdaScale needs init_batch (M0) to turn a noise scale into a gain")
        return gain_from_noise_scale(phi, self.init_batch, scale)

    def multiplier(self, scale: float) -> float:
        return self.gain(scale) ** self.power

    def __repr__(self):
        return f"AdaScale(power={self.power}, init_batch={self.init_batch})"
