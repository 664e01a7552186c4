"""Initialisations: small random Gaussian, and Saxe et al.'s balanced, aligned ("decoupled") start."""
from __future__ import annotations

import numpy as np

from .mlp import MLP
from .tasks import _orthogonal

__all__ = ["random_init", "aligned_init"]


def random_init(widths, scale: float, slope: float = 0.0, biases: bool = False, seed: int = 0,
                fan_in: bool = False, bias_scale: float = 0.0) -> MLP:
    """W_j with i.i.d. N(0, scale²) entries (N(0, scale²/fan_in) when ``fan_in``); biases
    N(0, bias_scale²)."""
    scale = float(scale)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"init scale must be a positive finite number, got {scale!r}")
    if bias_scale < 0:
        raise ValueError(f"bias_scale must be >= 0, got {bias_scale!r}")
    net = MLP(widths, slope=slope, has_bias=biases)
    rng = np.random.default_rng(seed)
    for w in net.weights:
        std = scale / np.sqrt(w.shape[1]) if fan_in else scale
        w[...] = rng.standard_normal(w.shape) * std
    if biases and bias_scale > 0:
        for b in net.biases:
            b[...] = rng.standard_normal(b.shape) * bias_scale
    return net


def aligned_init(U, V, u0, depth: int, width: int | None = None, seed: int = 0) -> MLP:
    """Balanced, aligned linear net with end-to-end map W_e = U·diag(u0)·Vᵀ (Saxe et al. 2014, Sec. 2-3).

    W_j = A_j·diag(u0^{1/N})·A_{j−1}ᵀ with A_0 = V, A_N = U and random A_j with orthonormal columns
    (width×m): then W_{j+1}ᵀW_{j+1} = W_jW_jᵀ (balanced) and each SVD mode of the teacher evolves on its own.
    """
    U = np.asarray(U, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    m = U.shape[1]
    if V.shape[1] != m:
        raise ValueError(f"U and V must have the same number of columns (modes), got {U.shape}, {V.shape}")
    depth = int(depth)
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    width = m if width is None else int(width)
    if depth > 1 and width < m:
        raise ValueError(f"width {width} is smaller than the number of modes {m}")
    u0 = np.broadcast_to(np.asarray(u0, dtype=np.float64), (m,))
    if np.any(u0 <= 0):
        raise ValueError(f"initial mode strengths u0 must be > 0, got {u0!r}")
    rng = np.random.default_rng(seed)
    A = [V] + [_orthogonal(width, rng)[:, :m] for _ in range(depth - 1)] + [U]
    c = u0 ** (1.0 / depth)
    ws = [(A[j + 1] * c) @ A[j].T for j in range(depth)]
    return MLP.from_weights(ws, slope=1.0)
