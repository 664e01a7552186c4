"""Deterministic full-batch gradient descent for :class:`~elasticlab.dynamics.mlp.MLP`, recorded in time.

θ_{k+1} = θ_k − η ∇L(θ_k) with L = 1/(2n) Σ‖f(x_μ) − y_μ‖²; in Saxe et al.'s units one step is dt = 1 and
τ = 1/η steps. The loop runs in one numba kernel (small matrices: Python overhead would dominate) and
stores the whole flat parameter vector at the recorded steps, so every quantity of interest (layer norms,
invariants, modes, masks) is computed afterwards, vectorised over time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from .mlp import MLP

__all__ = ["Trajectory", "train", "gradient", "record_steps"]


@numba.njit(cache=True)
def _loss_grad(params, widths, w_off, b_off, X, Y, slope, Z, H, a_off, grad):
    """Forward pass, then backprop of L = 1/(2n)Σ‖f(x)−y‖² into ``grad``; returns L."""
    L = widths.shape[0] - 1
    n = X.shape[0]
    hin = X
    for j in range(L):
        din = widths[j]
        dout = widths[j + 1]
        W = params[w_off[j]:w_off[j] + dout * din].reshape((dout, din))
        z = Z[a_off[j]:a_off[j] + n * dout].reshape((n, dout))
        z[:, :] = np.dot(hin, W.T)
        if b_off[j] >= 0:
            for i in range(n):
                for k in range(dout):
                    z[i, k] += params[b_off[j] + k]
        h = H[a_off[j]:a_off[j] + n * dout].reshape((n, dout))
        if j < L - 1:
            for i in range(n):
                for k in range(dout):
                    v = z[i, k]
                    h[i, k] = v if v > 0.0 else slope * v
        else:
            h[:, :] = z
        hin = h
    G = (hin - Y) / n
    val = 0.5 * n * np.sum(G * G)
    for j in range(L - 1, -1, -1):
        din = widths[j]
        dout = widths[j + 1]
        if j == 0:
            hprev = X
        else:
            hprev = H[a_off[j - 1]:a_off[j - 1] + n * din].reshape((n, din))
        gW = grad[w_off[j]:w_off[j] + dout * din].reshape((dout, din))
        gW[:, :] = np.dot(G.T, hprev)
        if b_off[j] >= 0:
            for k in range(dout):
                acc = 0.0
                for i in range(n):
                    acc += G[i, k]
                grad[b_off[j] + k] = acc
        if j > 0:
            W = params[w_off[j]:w_off[j] + dout * din].reshape((dout, din))
            Gp = np.dot(G, W)
            zp = Z[a_off[j - 1]:a_off[j - 1] + n * din].reshape((n, din))
            for i in range(n):
                for k in range(din):
                    if not zp[i, k] > 0.0:
                        Gp[i, k] *= slope
            G = Gp
    return val


@numba.njit(cache=True)
def _gd(params, widths, w_off, b_off, X, Y, slope, lr, steps, rec_steps, rec_params, rec_loss):
    """Run ``steps`` GD steps in place; record params and loss at ``rec_steps``. Returns records written
    (fewer than len(rec_steps) when the loss stops being finite)."""
    L = widths.shape[0] - 1
    n = X.shape[0]
    a_off = np.zeros(L + 1, dtype=np.int64)
    for j in range(L):
        a_off[j + 1] = a_off[j] + n * widths[j + 1]
    Z = np.empty(a_off[L])
    H = np.empty(a_off[L])
    grad = np.zeros(params.shape[0])
    r = 0
    R = rec_steps.shape[0]
    for k in range(steps + 1):
        val = _loss_grad(params, widths, w_off, b_off, X, Y, slope, Z, H, a_off, grad)
        if not np.isfinite(val):
            return r
        if r < R and rec_steps[r] == k:
            rec_params[r, :] = params
            rec_loss[r] = val
            r += 1
        if k == steps:
            break
        for i in range(params.shape[0]):
            params[i] -= lr * grad[i]
    return r


def _prep(net: MLP, X, Y):
    X = np.ascontiguousarray(net._check_inputs(X))
    Y = np.ascontiguousarray(np.asarray(Y, dtype=np.float64))
    if Y.ndim == 1 and net.widths[-1] == 1:
        Y = Y[:, None]
    if Y.shape != (X.shape[0], net.widths[-1]):
        raise ValueError(f"targets must have shape ({X.shape[0]}, {net.widths[-1]}), got {Y.shape}")
    return X, Y


def gradient(net: MLP, X, Y, params=None):
    """(∇L as a flat vector laid out like ``net.params``, L) at ``params`` (default: the net's own)."""
    X, Y = _prep(net, X, Y)
    p = np.ascontiguousarray(net.params if params is None else params, dtype=np.float64).copy()
    n = X.shape[0]
    a_off = np.concatenate([[0], np.cumsum(n * np.asarray(net.widths[1:], dtype=np.int64))]).astype(np.int64)
    Z = np.empty(a_off[-1])
    H = np.empty(a_off[-1])
    g = np.zeros_like(p)
    val = _loss_grad(p, net._w, net._wo, net._bo, X, Y, net.slope, Z, H, a_off, g)
    return g, float(val)


def record_steps(steps: int, every: int | None = None, points: int | None = None, log: bool = False):
    """The steps at which :func:`train` records: every ``every`` steps, or ``points`` of them (log-spaced
    when ``log``), always including 0 and ``steps``."""
    steps = int(steps)
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if every is not None and int(every) < 1:
        raise ValueError(f"record_every must be >= 1, got {every}")
    if points is not None and int(points) < 2:
        raise ValueError(f"record_points must be >= 2, got {points}")
    if every is not None:
        s = np.arange(0, steps + 1, int(every))
    elif points is not None:
        s = (np.geomspace(1, steps + 1, int(points)) - 1 if log else np.linspace(0, steps, int(points)))
        s = np.round(s).astype(np.int64)
    else:
        s = np.arange(steps + 1)
    return np.unique(np.concatenate([[0], s, [steps]]).astype(np.int64))


@dataclass
class Trajectory:
    """What :func:`train` recorded: ``steps`` (R,), flat ``params`` (R, P) and ``loss`` (R,) at those steps,
    the learning rate ``lr``, the trained ``net`` and whether the run ``diverged`` (non-finite loss)."""

    net: MLP
    steps: np.ndarray
    params: np.ndarray
    loss: np.ndarray
    lr: float
    diverged: bool = False

    @property
    def time(self) -> np.ndarray:
        """Gradient-flow time t = η·k (Saxe's t/τ in units of τ = 1/η)."""
        return self.lr * self.steps

    @property
    def weights(self) -> list:
        """Per layer, the recorded weight matrices, each of shape (R, out, in)."""
        return self.net.weights_at(self.params)

    @property
    def biases(self) -> list | None:
        return self.net.biases_at(self.params)

    @property
    def weight_norms(self) -> np.ndarray:
        """‖W_j‖²_F over time, shape (R, L)."""
        return np.stack([np.einsum("rij,rij->r", w, w) for w in self.weights], axis=1)

    @property
    def bias_norms(self) -> np.ndarray:
        """‖b_j‖² over time, shape (R, L); zeros for a bias-free net."""
        if not self.net.has_bias:
            return np.zeros((len(self.steps), self.net.depth))
        return np.stack([np.einsum("ri,ri->r", b, b) for b in self.biases], axis=1)

    @property
    def growth(self) -> np.ndarray:
        """‖W_j(T)‖²_F − ‖W_j(0)‖²_F per layer: the 'layer growth' of Du et al. (2018)."""
        n = self.weight_norms
        return n[-1] - n[0]

    def end_to_end(self) -> np.ndarray:
        """W_e(t) = W_L···W_1 over time, shape (R, out, in); linear nets only."""
        if self.net.slope != 1.0:
            raise ValueError("end_to_end needs a linear net (slope=1)")
        ws = self.weights
        we = ws[0]
        for w in ws[1:]:
            we = w @ we
        return we


def train(net: MLP, X, Y, lr: float, steps: int, record_every: int | None = None,
          record_points: int | None = None, log_records: bool = False) -> Trajectory:
    """Full-batch gradient descent from ``net`` (left unchanged) for ``steps`` steps at learning rate ``lr``.

    Records at the steps of :func:`record_steps`. Stops early, with ``diverged=True``, if the loss stops
    being finite.
    """
    lr = float(lr)
    if not np.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    X, Y = _prep(net, X, Y)
    rec = record_steps(steps, record_every, record_points, log_records)
    p = net.params.copy()
    rec_params = np.empty((len(rec), p.size))
    rec_loss = np.empty(len(rec))
    r = _gd(p, net._w, net._wo, net._bo, X, Y, net.slope, lr, int(steps), rec, rec_params, rec_loss)
    out = MLP(net.widths, net.slope, net.has_bias, p)
    return Trajectory(out, rec[:r], rec_params[:r], rec_loss[:r], lr, diverged=r < len(rec))

