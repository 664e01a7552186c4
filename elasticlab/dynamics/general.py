"""Linear (and bias-free ReLU) nets from an arbitrary start: theory/03 §3.1.

Under gradient flow every layer's ‖W_j‖²_F grows at the same rate r = (2/n)Σ_μ⟨y_μ − f(x_μ), f(x_μ)⟩
(Eq. (3.1)), so relative rates are ordered inversely to the norms (3.2); GD departs from it by at most
1.1·η·(loss drop) (3.3). C_j = W_{j+1}ᵀW_{j+1} − W_jW_jᵀ bounds the gap between adjacent layers' squared
singular values (Weyl, (3.4)) and, over the eigengap, their misalignment (Davis–Kahan, (3.5)).
"""
from __future__ import annotations

import numpy as np

from .invariants import balancedness
from .train import gradient

__all__ = ["flow_rates", "common_rate", "drift_bound", "adjacent_sv_gap", "alignment_sin",
           "davis_kahan_bound", "relative_imbalance"]


def flow_rates(net, X, Y, params=None) -> np.ndarray:
    """d‖W_j‖²_F/dt = −2⟨W_j, ∇_{W_j}L⟩ under gradient flow, per layer (theory/03 Eq. (3.1))."""
    p = net.params if params is None else np.asarray(params, dtype=np.float64)
    g, _ = gradient(net, X, Y, p)
    return np.array([-2.0 * float(np.sum(w * gw)) for w, gw in zip(net.weights_at(p), net.weights_at(g))])


def common_rate(net, X, Y, params=None) -> float:
    """r = (2/n)Σ_μ⟨y_μ − f(x_μ), f(x_μ)⟩: every layer's rate for linear and bias-free ReLU nets (3.1)."""
    f = net.forward(X, params)
    Y = np.asarray(Y, dtype=np.float64).reshape(f.shape)
    return float(2.0 * np.sum((Y - f) * f) / f.shape[0])


def drift_bound(lr: float, loss_a: float, loss_b: float, factor: float = 1.1) -> float:
    """Bound (3.3) on |Δn_j − Δn_k| over a stretch of GD whose loss fell from loss_a to loss_b."""
    return float(factor * lr * max(loss_a - loss_b, 0.0))


def _sym_eigs(a):
    return np.linalg.eigvalsh(a)[..., ::-1]


def adjacent_sv_gap(traj) -> np.ndarray:
    """max_k |σ_k(W_{j+1})² − σ_k(W_j)²| per record and j, shape (R, L−1); Weyl: ≤ ‖C_j‖₂ (3.4)."""
    ws = traj.weights
    sw = lambda a: np.swapaxes(a, -1, -2)  # noqa: E731
    out = [np.abs(_sym_eigs(sw(ws[j + 1]) @ ws[j + 1]) - _sym_eigs(ws[j] @ sw(ws[j]))).max(axis=-1)
           for j in range(len(ws) - 1)]
    return np.stack(out, axis=1)


def alignment_sin(traj) -> np.ndarray:
    """sin θ_j between the top left singular vector of W_j and the top right one of W_{j+1}, (R, L−1)."""
    ws = traj.weights
    out = []
    for j in range(len(ws) - 1):
        u = np.linalg.svd(ws[j])[0][..., :, 0]
        v = np.linalg.svd(ws[j + 1])[2][..., 0, :]
        c = np.abs(np.einsum("ri,ri->r", u, v))
        out.append(np.sqrt(np.clip(1.0 - c * c, 0.0, 1.0)))
    return np.stack(out, axis=1)


def davis_kahan_bound(traj, c_norm=None) -> np.ndarray:
    """2‖C_j‖₂/(λ₁ − λ₂)(W_jW_jᵀ) per record, (R, L−1) (Eq. (3.5)); ``c_norm`` (L−1,) replaces ‖C_j(t)‖₂
    (e.g. by ‖C_j(0)‖₂); inf where the gap is 0."""
    ws = traj.weights
    cs = balancedness(ws)
    out = []
    for j in range(len(ws) - 1):
        lam = _sym_eigs(ws[j] @ np.swapaxes(ws[j], -1, -2))
        gap = lam[..., 0] - lam[..., 1]
        cn = np.linalg.norm(cs[j], ord=2, axis=(-2, -1)) if c_norm is None else np.full(gap.shape, c_norm[j])
        with np.errstate(divide="ignore"):
            out.append(np.where(gap > 0, 2.0 * cn / np.where(gap > 0, gap, 1.0), np.inf))
    return np.stack(out, axis=1)


def relative_imbalance(traj) -> np.ndarray:
    """ρ_j = ‖C_j‖_F / ‖W_jW_jᵀ‖_F per record, (R, L−1) (theory/03 §3.1)."""
    ws = traj.weights
    cs = balancedness(ws)
    out = [np.linalg.norm(cs[j], axis=(-2, -1))
           / np.linalg.norm(ws[j] @ np.swapaxes(ws[j], -1, -2), axis=(-2, -1)) for j in range(len(cs))]
    return np.stack(out, axis=1)
