"""The two tasks of the P3 experiments: Saxe et al.'s whitened linear teacher, and a synthetic regression.

Saxe et al. (2014) Eq. (2)-(3): with whitened inputs (Σ11 = I) the squared loss of a linear student only
depends on the input-output correlation Σ31 = U S Vᵀ. Feeding the n = d_in inputs x_μ = √d_in·e_μ gives
XᵀX/n = I exactly, so the data loss 1/(2n)Σ‖y − W_e x‖² equals ½‖Σ31 − W_e‖²_F.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SaxeTask", "saxe_task", "whitened_inputs", "regression_task"]


def _orthogonal(d: int, rng) -> np.ndarray:
    """Haar-random orthogonal d×d matrix (scipy.stats.ortho_group, imported lazily: it is slow to load)."""
    from scipy.stats import ortho_group

    return np.eye(1) if d == 1 else ortho_group.rvs(d, random_state=rng)


def whitened_inputs(d: int, symmetric: bool = False) -> np.ndarray:
    """n = d inputs √d·e_μ (with ``symmetric``, n = 2d inputs ±√d·e_μ), so that Σ11 = XᵀX/n = I exactly.
    The symmetric set gives ReLU students inputs of both signs."""
    if int(d) < 1:
        raise ValueError(f"input dimension must be >= 1, got {d}")
    X = np.sqrt(d) * np.eye(int(d))
    return np.concatenate([X, -X]) if symmetric else X


@dataclass
class SaxeTask:
    """Teacher Σ31 = U·diag(s)·Vᵀ (U: d_out×m, V: d_in×m, m = min(d_in, d_out)) and its whitened data."""

    U: np.ndarray
    s: np.ndarray
    V: np.ndarray
    X: np.ndarray
    Y: np.ndarray

    @property
    def target(self) -> np.ndarray:
        return (self.U * self.s) @ self.V.T

    @property
    def distinct_nonzero(self) -> int:
        """Number of distinct nonzero singular values (one learning step each, P3-T3)."""
        nz = self.s[self.s > 1e-12]
        return len(np.unique(np.round(nz, 12)))


def saxe_task(s, d_in: int | None = None, d_out: int | None = None, seed: int = 0,
              symmetric: bool = False) -> SaxeTask:
    """Random orthogonal U, V (seeded); singular values ``s`` padded with zeros to m = min(d_in, d_out)."""
    s = np.asarray(s, dtype=np.float64).ravel()
    if s.size == 0 or np.any(s < 0) or not np.all(np.isfinite(s)):
        raise ValueError(f"singular values must be a non-empty list of finite numbers >= 0, got {s!r}")
    d_in = s.size if d_in is None else int(d_in)
    d_out = d_in if d_out is None else int(d_out)
    m = min(d_in, d_out)
    if s.size > m:
        raise ValueError(f"{s.size} singular values do not fit a {d_out}x{d_in} map (at most {m})")
    s = np.concatenate([s, np.zeros(m - s.size)])
    rng = np.random.default_rng(seed)
    U = _orthogonal(d_out, rng)[:, :m]
    V = _orthogonal(d_in, rng)[:, :m]
    X = whitened_inputs(d_in, symmetric)
    Y = X @ ((U * s) @ V.T).T
    return SaxeTask(U, s, V, X, Y)


def regression_task(n: int = 200, d_in: int = 10, d_out: int = 3, hidden: int = 16, offset: float = 0.0,
                    seed: int = 0):
    """Fixed synthetic regression for the ReLU experiments (P3-T4/T5): Gaussian inputs, targets from a
    random one-hidden-layer ReLU teacher with hidden biases (so a student's biases have work to do), plus
    a constant ``offset``. Returns (X, Y)."""
    if min(n, d_in, d_out, hidden) < 1:
        raise ValueError(f"n, d_in, d_out, hidden must be >= 1, got {(n, d_in, d_out, hidden)}")
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d_in))
    A = rng.standard_normal((hidden, d_in)) / np.sqrt(d_in)
    c = rng.standard_normal(hidden) * 0.5
    B = rng.standard_normal((d_out, hidden)) / np.sqrt(hidden)
    Y = np.maximum(X @ A.T + c, 0.0) @ B.T + offset
    return X, Y
