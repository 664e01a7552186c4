"""Linearisation of a ReLU net through its activation masks (P3's "linearised neural nets", P3-T6).

With D_j(x) = diag(σ'(z_j(x))) (1 where the unit is active, ``slope`` where not), a ReLU/leaky net is, for
each input, exactly a linear map plus offset:

    f(x) = W_eff(x)·x + b_eff(x),   W_eff(x) = W_L·D_{L−1}(x)·W_{L−1}···D_1(x)·W_1,
    b_eff(x) = Σ_j W_L·D_{L−1}(x)···W_{j+1}·D_j(x)·b_j + b_L   (b_L alone for j = L).

Within the region where the masks stay fixed, training moves a deep linear net (the masked layers D_jW_j).
"""
from __future__ import annotations

import numpy as np

__all__ = ["activation_masks", "effective_maps", "linearised_forward", "exactness_error",
           "masked_layer_norms", "mask_change"]


def _params(net, params):
    return net.params if params is None else np.asarray(params, dtype=np.float64)


def activation_masks(net, X, params=None) -> list:
    """D_j(x) as an (n, width_j) array of slopes (1 active, ``net.slope`` inactive), j = 1..L−1."""
    X = net._check_inputs(X)
    p = _params(net, params)
    ws = net.weights_at(p)
    bs = net.biases_at(p)
    h = X
    masks = []
    for j in range(net.depth - 1):
        z = h @ ws[j].T
        if bs is not None:
            z = z + bs[j]
        d = np.where(z > 0, 1.0, net.slope)
        masks.append(d)
        h = d * z
    return masks


def effective_maps(net, X, params=None):
    """(W_eff (n, d_out, d_in), b_eff (n, d_out)) of the linearised net at each input."""
    X = net._check_inputs(X)
    p = _params(net, params)
    ws = net.weights_at(p)
    bs = net.biases_at(p)
    masks = activation_masks(net, X, p)
    n = X.shape[0]
    weff = np.broadcast_to(ws[0], (n,) + ws[0].shape)
    beff = np.broadcast_to(bs[0], (n, ws[0].shape[0])) if bs is not None else np.zeros((n, ws[0].shape[0]))
    for j in range(1, net.depth):
        d = masks[j - 1]
        weff = np.einsum("ok,nk,nki->noi", ws[j], d, weff)
        beff = np.einsum("ok,nk,nk->no", ws[j], d, beff)
        if bs is not None:
            beff = beff + bs[j]
    return np.ascontiguousarray(weff), np.ascontiguousarray(beff)


def linearised_forward(net, X, params=None) -> np.ndarray:
    """W_eff(x)·x + b_eff(x) for every row x of X."""
    X = net._check_inputs(X)
    weff, beff = effective_maps(net, X, params)
    return np.einsum("noi,ni->no", weff, X) + beff


def exactness_error(net, X, params=None) -> float:
    """max |linearised − true output| / max(1, max|output|): zero up to float64 rounding."""
    f = net.forward(X, params)
    lin = linearised_forward(net, X, params)
    return float(np.abs(lin - f).max() / max(1.0, float(np.abs(f).max())))


def masked_layer_norms(traj, X) -> np.ndarray:
    """E_x ‖D_j(x)·W_j‖²_F over the recorded steps, shape (R, L) (the last layer has no mask)."""
    net = traj.net
    out = np.empty((len(traj.steps), net.depth))
    for r, p in enumerate(traj.params):
        ws = net.weights_at(p)
        masks = activation_masks(net, X, p)
        for j, w in enumerate(ws):
            rows = np.sum(w * w, axis=1)
            out[r, j] = rows.sum() if j == net.depth - 1 else float(np.mean(masks[j] ** 2 @ rows))
    return out


def mask_change(traj, X) -> np.ndarray:
    """Fraction of activation-mask entries (all hidden units, all inputs) differing from the initial masks,
    over the recorded steps, shape (R,)."""
    net = traj.net
    m0 = np.concatenate([m.ravel() for m in activation_masks(net, X, traj.params[0])])
    out = np.empty(len(traj.steps))
    for r, p in enumerate(traj.params):
        m = np.concatenate([m.ravel() for m in activation_masks(net, X, p)])
        out[r] = float(np.mean(m != m0))
    return out
