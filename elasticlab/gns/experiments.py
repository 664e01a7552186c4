"""Estimator experiments on synthetic linear regression with a known B_simple (papers.md P5-T1, P5-T2).

A finite population of N examples defines the truth exactly: G = mean_i g_i, Σ = population covariance of
the per-example gradients g_i = x_i (x_iᵀw − y_i) of ℓ_i = ½(x_iᵀw − y_i)², so B_simple = tr Σ/‖G‖²
(McCandlish Eq. 2.9). Batches are drawn with replacement, which makes both estimators exactly unbiased.
"""
from __future__ import annotations

import numpy as np

from elasticlab.gns.estimator import two_batch_estimates


def linear_regression_population(dim: int = 20, size: int = 200_000, noise: float = 0.52,
                                 offset: float = 0.3127, seed: int = 0):
    """Per-example gradients (size, dim) at a fixed w, and the exact (‖G‖², tr Σ, B_simple)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size, dim))
    w_true = rng.standard_normal(dim)
    y = x @ w_true + noise * rng.standard_normal(size)
    w = w_true + offset * rng.standard_normal(dim)
    g = x * (x @ w - y)[:, None]
    G = g.mean(0)
    trace_cov = float(((g - G) ** 2).sum(1).mean())
    g2 = float(G @ G)
    return g, {"grad_sq": g2, "trace_cov": trace_cov, "b_simple": trace_cov / g2}


def draw_estimates(g: np.ndarray, b_small: int, b_big: int = 64, draws: int = 3000, seed: int = 1):
    """(‖G‖²_est, S_est) arrays over ``draws`` batches of b_big, each split into b_big/b_small micro-batches
    (as replicas or accumulation steps); b_small=1 is the per-example form."""
    if b_big % b_small or b_small >= b_big:
        raise ValueError(f"b_small must divide b_big and be smaller: got b_small={b_small}, b_big={b_big}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, g.shape[0], size=(draws, b_big))
    batch = g[idx]                                                  # (draws, b_big, D)
    micro = batch.reshape(draws, b_big // b_small, b_small, -1).mean(2)
    small = (micro ** 2).sum(-1).mean(1)                            # mean over micro-batches of ‖G_small‖²
    big = (batch.mean(1) ** 2).sum(-1)
    return two_batch_estimates(small, big, b_small, b_big)


def unbiasedness(draws: int = 3000, settings=((1, 64), (8, 64), (32, 64)), seed: int = 0) -> dict:
    """P5-T1: mean ‖G‖²_est, S_est and the ratio-of-means B_simple per (b_small, b_big), with the truth."""
    g, truth = linear_regression_population(seed=seed)
    out = {"truth": truth, "settings": {}}
    for i, (bs, bb) in enumerate(settings):
        g2, s = draw_estimates(g, bs, bb, draws, seed=seed + 1 + i)
        out["settings"][(bs, bb)] = {"grad_sq": float(g2.mean()), "trace_cov": float(s.mean()),
                                     "b_simple": float(s.mean() / g2.mean())}
    return out


def variance_ordering(draws: int = 3000, b_big: int = 64, b_smalls=(32, 16, 8, 4, 2, 1),
                      seed: int = 0) -> dict:
    """P5-T2 (Gray et al. Fig. 2): std of S_est and of ‖G‖²_est across draws, per b_small at fixed b_big."""
    g, truth = linear_regression_population(seed=seed)
    std_s, std_g2 = {}, {}
    for bs in b_smalls:
        g2, s = draw_estimates(g, bs, b_big, draws, seed=seed + 100)   # same batches for every split
        std_s[bs], std_g2[bs] = float(s.std()), float(g2.std())
    return {"truth": truth, "std_trace_cov": std_s, "std_grad_sq": std_g2}
