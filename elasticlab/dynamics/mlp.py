"""Fully-connected nets f(x) = W_L·σ(W_{L−1}···σ(W_1 x + b_1)··· + b_{L−1}) + b_L, in float64.

One class covers the three nets of Du et al. (2018): linear (``slope=1``), ReLU (``slope=0``) and leaky-ReLU
(``0 < slope < 1``), with or without biases. Parameters live in one flat float64 vector so that the numba
training kernel (:mod:`elasticlab.dynamics.train`) can update and record them without Python overhead;
``weights``/``biases`` are views into it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["MLP", "loss", "layout"]


def layout(widths, biases: bool):
    """Offsets of every W_j (shape widths[j+1]×widths[j]) and b_j in the flat parameter vector."""
    widths = [int(w) for w in widths]
    if len(widths) < 2:
        raise ValueError(f"widths must list at least an input and an output size, got {widths!r}")
    if any(w < 1 for w in widths):
        raise ValueError(f"every width must be >= 1, got {widths!r}")
    L = len(widths) - 1
    w_off = np.zeros(L, dtype=np.int64)
    b_off = np.full(L, -1, dtype=np.int64)
    o = 0
    for j in range(L):
        w_off[j] = o
        o += widths[j + 1] * widths[j]
    if biases:
        for j in range(L):
            b_off[j] = o
            o += widths[j + 1]
    return np.asarray(widths, dtype=np.int64), w_off, b_off, o


@dataclass
class MLP:
    """A fully-connected net with activation σ(z) = max(z, 0) + slope·min(z, 0).

    ``slope=0``: ReLU; ``slope=1``: deep linear net. ``params`` is the flat float64 parameter vector.
    """

    widths: tuple
    slope: float = 0.0
    has_bias: bool = False
    params: np.ndarray = field(default=None, repr=False)

    def __post_init__(self):
        self.widths = tuple(int(w) for w in self.widths)
        if not (0.0 <= float(self.slope) <= 1.0):
            raise ValueError(f"slope must lie in [0, 1] (0: ReLU, 1: linear), got {self.slope!r}")
        self.slope = float(self.slope)
        self._w, self._wo, self._bo, n = layout(self.widths, self.has_bias)
        if self.params is None:
            self.params = np.zeros(n)
        else:
            p = np.ascontiguousarray(self.params, dtype=np.float64).ravel()
            if p.size != n:
                raise ValueError(f"params has {p.size} entries but widths {self.widths} need {n}")
            self.params = p.copy()

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_weights(cls, weights, biases=None, slope: float = 0.0) -> MLP:
        """Build from a list of weight matrices W_j (out×in) and optionally biases b_j."""
        weights = [np.asarray(w, dtype=np.float64) for w in weights]
        if not weights or any(w.ndim != 2 for w in weights):
            raise ValueError("weights must be a non-empty list of 2-D arrays")
        widths = [weights[0].shape[1]] + [w.shape[0] for w in weights]
        for j in range(1, len(weights)):
            if weights[j].shape[1] != weights[j - 1].shape[0]:
                raise ValueError(f"weights[{j}] has shape {weights[j].shape}, expected "
                                 f"({weights[j].shape[0]}, {weights[j - 1].shape[0]})")
        net = cls(widths, slope=slope, has_bias=biases is not None)
        for j, w in enumerate(weights):
            net.weights[j][...] = w
        if biases is not None:
            if len(biases) != len(weights):
                raise ValueError(f"got {len(biases)} biases for {len(weights)} layers")
            for j, b in enumerate(biases):
                b = np.asarray(b, dtype=np.float64).ravel()
                if b.size != widths[j + 1]:
                    raise ValueError(f"biases[{j}] has {b.size} entries, expected {widths[j + 1]}")
                net.biases[j][...] = b
        return net

    def copy(self) -> MLP:
        return MLP(self.widths, self.slope, self.has_bias, self.params.copy())

    # ---- views -----------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Number of weight matrices L."""
        return len(self.widths) - 1

    def _views(self, params):
        ws = self.widths
        return [params[self._wo[j]:self._wo[j] + ws[j + 1] * ws[j]].reshape(ws[j + 1], ws[j])
                for j in range(self.depth)]

    @property
    def weights(self) -> list:
        return self._views(self.params)

    @property
    def biases(self) -> list | None:
        if not self.has_bias:
            return None
        return [self.params[self._bo[j]:self._bo[j] + self.widths[j + 1]] for j in range(self.depth)]

    def weights_at(self, params) -> list:
        """Weight matrices of a recorded parameter vector (or a stack of them: leading axis kept)."""
        params = np.asarray(params)
        if params.ndim == 1:
            return self._views(params)
        ws = self.widths
        return [params[:, self._wo[j]:self._wo[j] + ws[j + 1] * ws[j]].reshape(-1, ws[j + 1], ws[j])
                for j in range(self.depth)]

    def biases_at(self, params) -> list | None:
        if not self.has_bias:
            return None
        params = np.asarray(params)
        return [params[..., self._bo[j]:self._bo[j] + self.widths[j + 1]] for j in range(self.depth)]

    # ---- evaluation ------------------------------------------------------------------------------
    def activation(self, z):
        return np.where(z > 0, z, self.slope * z)

    def forward(self, X, params=None) -> np.ndarray:
        """Outputs for inputs X (n×d_0)."""
        X = self._check_inputs(X)
        params = self.params if params is None else params
        h = X
        ws = self._views(params)
        bs = None if not self.has_bias else [params[self._bo[j]:self._bo[j] + self.widths[j + 1]]
                                             for j in range(self.depth)]
        for j, w in enumerate(ws):
            h = h @ w.T
            if bs is not None:
                h = h + bs[j]
            if j < self.depth - 1:
                h = self.activation(h)
        return h

    __call__ = forward

    def end_to_end(self, params=None) -> np.ndarray:
        """W_e = W_L···W_1, the end-to-end matrix of a linear net (Saxe et al. 2014; Arora et al. 2018)."""
        if self.slope != 1.0:
            raise ValueError(f"end_to_end needs a linear net (slope=1); this net has slope {self.slope}")
        params = self.params if params is None else np.asarray(params)
        ws = self.weights_at(params)
        we = ws[0]
        for w in ws[1:]:
            we = w @ we
        return we

    def _check_inputs(self, X):
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != self.widths[0]:
            raise ValueError(f"inputs must have shape (n, {self.widths[0]}), got {X.shape}")
        return X


def loss(net: MLP, X, Y, params=None) -> float:
    """Squared loss L = 1/(2n) Σ_μ ‖f(x_μ) − y_μ‖² (with whitened inputs: ½‖Σ31 − W_e‖²_F, Saxe Eq. (2))."""
    Y = np.asarray(Y, dtype=np.float64)
    r = net.forward(X, params) - Y
    return 0.5 * float(np.sum(r * r)) / r.shape[0]
