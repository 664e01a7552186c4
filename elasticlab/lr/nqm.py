"""The noisy quadratic model (Zhang et al. 2019, NeurIPS; used by Lin et al. for Dynamic SGD).

``L(w) = 1/2 sum_i h_i w_i^2``; a mini-batch gradient of size b is ``h * w + sqrt(h / b) * xi`` with
xi ~ N(0, I), i.e. per-example covariance Sigma = diag(h), tr(Sigma) = sum(h). Rows of ``w`` are
independent replicas (seeds), so one torch tensor runs many seeds at once.
"""
from __future__ import annotations

import math

import numpy as np
import torch


class NoisyQuadratic:
    def __init__(self, dim: int = 1000, h_min: float = 1e-3, h_max: float = 1.0, noise: bool = True,
                 dtype=torch.float64):
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if not 0 < h_min <= h_max:
            raise ValueError(f"need 0 < h_min <= h_max, got {h_min}, {h_max}")
        self.h = torch.logspace(math.log10(h_min), math.log10(h_max), int(dim), dtype=dtype)
        self.noise = bool(noise)

    @property
    def dim(self) -> int:
        return self.h.numel()

    def loss(self, w: torch.Tensor) -> torch.Tensor:
        """Loss of each replica (rows of ``w``)."""
        return 0.5 * (self.h * w * w).sum(-1)

    def grad_sq(self, w: torch.Tensor) -> torch.Tensor:
        """|grad L|^2 of each replica."""
        return ((self.h * w) ** 2).sum(-1)

    def trace_cov(self) -> float:
        """tr(Sigma) of one example's gradient (0 without noise)."""
        return float(self.h.sum()) if self.noise else 0.0

    def grad(self, w: torch.Tensor, batch: float, generator: torch.Generator | None = None) -> torch.Tensor:
        """A mini-batch gradient of size ``batch`` at ``w``."""
        g = self.h * w
        if self.noise:
            xi = torch.randn(w.shape, generator=generator, dtype=w.dtype)
            g = g + torch.sqrt(self.h / batch) * xi
        return g

    def worker_grads(self, w: torch.Tensor, workers: int, batch: float,
                     generator: torch.Generator | None = None) -> torch.Tensor:
        """``workers`` independent gradients of size ``batch`` each, shape (workers, *w.shape)."""
        g = (self.h * w).expand(workers, *w.shape)
        if self.noise:
            xi = torch.randn((workers, *w.shape), generator=generator, dtype=w.dtype)
            g = g + torch.sqrt(self.h / batch) * xi
        return g

    def worker_moments(self, w: torch.Tensor, workers: int, batch: float, rng: np.random.Generator,
                       generator: torch.Generator | None = None):
        """What S workers' gradients of size ``batch`` give, sampled without drawing them one by one:
        their mean (an exact draw at batch S*batch) and the sum of their squared norms,
        ``S |g_bar|^2 + sum_j (h_j / batch) chi^2_{S-1}`` (the spread around the mean is independent of
        it for Gaussian noise). Cost O(dim), not O(S * dim)."""
        mean = self.grad(w, workers * batch, generator)
        sum_sq = workers * float((mean * mean).sum())
        if self.noise and workers > 1:
            chi2 = rng.chisquare(workers - 1, size=tuple(w.shape))
            sum_sq += float(((self.h / batch).numpy() * chi2).sum())
        return mean, sum_sq
