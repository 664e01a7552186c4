"""Pockets of the data space: where a ReLU net's masks stay fixed it is a linear net (theory/03 §3.2).

``pairwise_rate``: Eq. (3.6), dC_j/dt = −(M + Mᵀ), M_ik = Σ_μ (d_k − d_i)·γ_i·z_k — an entry of C_j is
conserved while units i and k have the same activity on every example. ``flow_state`` gives the
pre-activations z and their flow derivatives ż; ``flip_estimate`` the first-order time (3.7) at which each
example's masks change; ``first_flips`` the measured one.
"""
from __future__ import annotations

import numpy as np

from .linearise import activation_masks
from .train import gradient

__all__ = ["flow_state", "pairwise_rate", "flip_estimate", "first_flips"]


def _wb(net, p):
    return net.weights_at(p), net.biases_at(p)


def flow_state(net, X, Y, params=None):
    """(z, ż, d) per hidden layer: pre-activations (n, w_j), their derivative along θ̇ = −∇L, and the masks."""
    X = net._check_inputs(X)
    p = net.params if params is None else np.asarray(params, dtype=np.float64)
    g, _ = gradient(net, X, Y, p)
    ws, bs = _wb(net, p)
    gws, gbs = _wb(net, g)
    h, hd = X, np.zeros_like(X)
    zs, zds, ds = [], [], []
    for j in range(net.depth - 1):
        z = h @ ws[j].T
        zd = -h @ gws[j].T + hd @ ws[j].T
        if bs is not None:
            z = z + bs[j]
            zd = zd - gbs[j]
        d = np.where(z > 0, 1.0, net.slope)
        zs.append(z)
        zds.append(zd)
        ds.append(d)
        h, hd = d * z, d * zd
    return zs, zds, ds


def pairwise_rate(net, X, Y, layer: int, params=None) -> np.ndarray:
    """dC_j/dt under gradient flow for hidden layer ``layer`` (between W_layer and W_layer+1, 0-based),
    C_j = W_{j+1}ᵀW_{j+1} − W_jW_jᵀ (− b_jb_jᵀ with biases), by Eq. (3.6)."""
    X = net._check_inputs(X)
    p = net.params if params is None else np.asarray(params, dtype=np.float64)
    ws, bs = _wb(net, p)
    n = X.shape[0]
    # forward
    zs, ds, hs = [], [], [X]
    for j in range(net.depth):
        z = hs[-1] @ ws[j].T + (bs[j] if bs is not None else 0.0)
        if j < net.depth - 1:
            d = np.where(z > 0, 1.0, net.slope)
            zs.append(z)
            ds.append(d)
            hs.append(d * z)
        else:
            f = z
    Yr = np.asarray(Y, dtype=np.float64).reshape(f.shape)
    delta = (f - Yr) / n
    for j in range(net.depth - 1, layer + 1, -1):
        delta = ds[j - 1] * (delta @ ws[j])
    gamma = delta @ ws[layer + 1]
    z, d = zs[layer], ds[layer]
    M = gamma.T @ (d * z) - (d * gamma).T @ z
    return -(M + M.T)


def flip_estimate(net, X, Y, params=None) -> np.ndarray:
    """T̂_μ = min over hidden entries with z·ż < 0 of −z/ż (units of τ; inf if none): Eq. (3.7)."""
    zs, zds, _ = flow_state(net, X, Y, params)
    z = np.concatenate(zs, axis=1)
    zd = np.concatenate(zds, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(z * zd < 0, -z / zd, np.inf)
    return t.min(axis=1)


def first_flips(traj, X) -> np.ndarray:
    """Per example, the first recorded step at which any hidden mask differs from the start (inf: never)."""
    net = traj.net
    m0 = np.concatenate(activation_masks(net, X, traj.params[0]), axis=1)
    out = np.full(m0.shape[0], np.inf)
    for r in range(1, len(traj.steps)):
        todo = ~np.isfinite(out)
        if not todo.any():
            break
        m = np.concatenate(activation_masks(net, X[todo], traj.params[r]), axis=1)
        changed = np.any(m != m0[todo], axis=1)
        idx = np.flatnonzero(todo)[changed]
        out[idx] = traj.steps[r]
    return out
