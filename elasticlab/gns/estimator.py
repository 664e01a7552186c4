"""Gradient noise scale estimators (McCandlish et al. 2018, App. A.1; Gray et al. 2024), bias-corrected EMAs.

Both forms use E‖G_B‖² = ‖G‖² + tr(Σ)/B (McCandlish Eq. A.1) at two batch sizes (Eq. A.2):
    ‖G‖²_est = (B_big‖G_big‖² − B_small‖G_small‖²)/(B_big − B_small)
    S_est    = (‖G_small‖² − ‖G_big‖²)/(1/B_small − 1/B_big)      (tr Σ, per-example units)
The per-example form is B_small = 1, ‖G_small‖² = mean_i ‖g_i‖² (the footnote after A.2): S_est is then the
Bessel-corrected variance of the per-example gradients. B_simple = tr Σ/‖G‖² (Eq. 2.9) is read out as a
ratio of the EMAs, never an EMA of ratios. Pollux's pair is (sqr, var) = (‖G‖², tr Σ/M0).
"""
from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
import torch

from elasticlab.checks import number, whole


def two_batch_estimates(small_sq_norm, big_sq_norm, b_small, b_big):
    """(‖G‖²_est, S_est) from squared norms at two batch sizes (McCandlish Eq. A.2); numpy-broadcasting."""
    b_small, b_big = np.asarray(b_small, dtype=float), np.asarray(b_big, dtype=float)
    ok = np.isfinite(b_small) & np.isfinite(b_big) & (b_small > 0) & (b_big > 0) & (b_small != b_big)
    if not np.all(ok):                              # ok has the broadcast shape: name the first bad pair
        i = np.unravel_index(np.argmin(ok), ok.shape)
        bs, bb = np.broadcast_to(b_small, ok.shape)[i], np.broadcast_to(b_big, ok.shape)[i]
        where = f" (at index {tuple(int(k) for k in i)})" if ok.ndim else ""
        raise ValueError(f"two_batch_estimates needs two different finite batch sizes > 0, got "
                         f"b_small={bs:g}, b_big={bb:g}{where}")
    small, big = np.asarray(small_sq_norm, dtype=float), np.asarray(big_sq_norm, dtype=float)
    g2 = (b_big * big - b_small * small) / (b_big - b_small)
    s = (small - big) / (1.0 / b_small - 1.0 / b_big)
    return g2, s


def per_example_estimates(mean_sq_norm, n, mean_grad_sq_norm):
    """(‖G‖²_est, S_est) from mean_i ‖g_i‖² over n examples and ‖ḡ‖² of their mean gradient."""
    return two_batch_estimates(mean_sq_norm, mean_grad_sq_norm, 1, n)


def _as_float(x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"expected a scalar squared norm, got a tensor of shape {tuple(x.shape)}")
        return float(x.detach().double())
    return float(x)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../elasticlab


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from its caller, of the first frame outside the elasticlab package:
    the user's line, however many of the package's own calls (update, monitor, callbacks) lie between."""
    level, frame = 2, sys._getframe(2)  # level 1: the function calling warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


class _Ema:
    __slots__ = ("g2", "s", "n")

    def __init__(self):
        self.g2, self.s, self.n = 0.0, 0.0, 0

    def fold(self, beta: float, g2: float, s: float) -> None:
        self.g2 = beta * self.g2 + (1 - beta) * g2
        self.s = beta * self.s + (1 - beta) * s
        self.n += 1

    def corrected(self, beta: float) -> tuple[float, float]:
        if self.n == 0:
            return float("nan"), float("nan")
        c = 1.0 - beta ** self.n
        return self.g2 / c, self.s / c

    def b_simple(self, beta: float) -> float:
        g2, s = self.corrected(beta)
        if self.n == 0:
            return float("nan")
        return s / g2 if g2 > 0 else float("inf")


def check_beta(beta) -> float:
    """The EMA decay as a float in [0, 1); a ValueError naming it otherwise."""
    return number("beta", beta, lambda b: 0.0 <= b < 1.0, "in [0, 1)")


class GNSEstimator:
    """Running ‖G‖², tr Σ and B_simple from per-example or two-batch gradient norms.

    ``beta``: EMA decay (bias-corrected, Adam-style). ``init_batch_size``: Pollux's M0 for ``var``.
    An update whose squared norms are not all finite and ≥ 0 (NaN, ±Inf, negative: no squared norm can be)
    is skipped and counted in ``skipped`` (``layer_skipped`` per layer), never folded into the EMAs; the
    first one also raises a ``RuntimeWarning`` (once per estimator).
    """

    def __init__(self, beta: float = 0.99, init_batch_size: int = 1):
        self.beta = check_beta(beta)
        self.init_batch_size = whole("init_batch_size", init_batch_size, 1, ">= 1")
        self._total = _Ema()
        self._layers: dict[str, _Ema] = {}
        self.skipped = 0
        self.layer_skipped: dict[str, int] = {}
        self._warned = False

    # ------------------------------------------------------------------------------------------ updates
    def _skip(self, layer: str | None, what: str) -> bool:
        """Counts a rejected update and warns about the first one; returns False (not folded)."""
        if layer is None:
            self.skipped += 1
        else:
            self.layer_skipped[layer] = self.layer_skipped.get(layer, 0) + 1
        if not self._warned:
            self._warned = True
            where = "" if layer is None else f" of layer {layer!r}"
            warnings.warn(f"GNSEstimator: skipped an update{where} with {what} (squared norms must be finite "
                          "and >= 0; NaN/Inf come from overflowed half-precision steps); such updates are "
                          "counted in `skipped` / `layer_skipped`, and this warning is shown once",
                          RuntimeWarning, stacklevel=_user_stacklevel())
        return False

    def _valid(self, layer: str | None, **sq_norms: float) -> bool:
        """Whether every named squared norm is finite and ≥ 0; else the update is skipped (:meth:`_skip`)."""
        bad = {k: v for k, v in sq_norms.items() if not (v >= 0.0 and math.isfinite(v))}
        if not bad:
            return True
        return self._skip(layer, ", ".join(f"{k}={v!r}" for k, v in bad.items()))

    def _fold(self, g2, s, layer: str | None = None) -> bool:
        g2, s = float(g2), float(s)
        if not (math.isfinite(g2) and math.isfinite(s)):
            return self._skip(layer, f"non-finite estimates (|G|^2={g2!r}, tr(Sigma)={s!r})")
        ema = self._total if layer is None else self._layers.setdefault(layer, _Ema())
        ema.fold(self.beta, g2, s)
        return True

    def update_per_example(self, mean_sq_norm: float, n: int, mean_grad_sq_norm: float,
                           layer: str | None = None) -> bool:
        """Per-example form from mean_i ‖g_i‖² over n ≥ 2 examples and ‖ḡ‖²; returns whether it was folded."""
        if n < 2:
            raise ValueError(f"the per-example estimator needs n >= 2 examples, got n={n}")
        mean_sq, grad_sq = _as_float(mean_sq_norm), _as_float(mean_grad_sq_norm)
        if not self._valid(layer, mean_sq_norm=mean_sq, mean_grad_sq_norm=grad_sq):
            return False
        return self._fold(*per_example_estimates(mean_sq, n, grad_sq), layer=layer)

    def update(self, sq_norms, mean_grad_sq_norm, layers: dict | None = None) -> bool:
        """Per-example form: ``sq_norms`` (B,) of ‖g_i‖² (``PerSampleGradNorms.sq_norms()``) and ‖ḡ‖² of the
        batch-mean gradient. ``layers``: optional {name: (layer sq_norms (B,), layer ‖ḡ‖²)}, per-layer GNS."""
        ok = self._update_rows(sq_norms, mean_grad_sq_norm, None)
        for name, (ln, lg) in (layers or {}).items():
            self._update_rows(ln, lg, name)
        return ok

    def _update_rows(self, sq_norms, mean_grad_sq_norm, layer: str | None) -> bool:
        """One per-example update from (B,) squared norms: every one must be finite and ≥ 0 (one host read
        of their minimum and mean)."""
        t = torch.as_tensor(sq_norms).detach().reshape(-1).double()
        if t.numel() < 2:
            return self.update_per_example(0.0, t.numel(), mean_grad_sq_norm, layer=layer)   # raises
        lo, mean = torch.stack([t.min(), t.mean()]).tolist()
        if not (lo >= 0.0 and math.isfinite(mean)):
            bad = t[~(torch.isfinite(t) & (t >= 0))]
            return self._skip(layer, f"{bad.numel()} of {t.numel()} per-example squared norms not finite "
                                     f"and >= 0 (e.g. {bad[0].item()!r})")
        return self.update_per_example(mean, t.numel(), mean_grad_sq_norm, layer=layer)

    def update_from(self, norms) -> bool:
        """Per-example update, total and per layer, from a ``PerSampleGradNorms`` after its backward (the
        parameters' ``.grad`` must hold this batch's gradient alone)."""
        sq = norms.sq_norms()
        lg = norms.layer_grad_sq_norms(sq.shape[0])
        ls = norms.layer_sq_norms()
        return self.update(sq, norms.grad_sq_norm(sq.shape[0]), layers={k: (ls[k], lg[k]) for k in ls})

    def update_two_batch(self, small_sq_norm: float, big_sq_norm: float, b_small: float, b_big: float,
                         layer: str | None = None) -> bool:
        """Two-batch form (McCandlish App. A.1): ‖G_small‖² (mean over the micro-batches or replicas of their
        gradients' squared norms, each of size b_small) and ‖G_big‖² of their average (size b_big)."""
        if not (0 < b_small < b_big):
            raise ValueError(f"the two-batch estimator needs 0 < b_small < b_big, got b_small={b_small}, "
                             f"b_big={b_big}")
        small, big = _as_float(small_sq_norm), _as_float(big_sq_norm)
        if not self._valid(layer, small_sq_norm=small, big_sq_norm=big):
            return False
        return self._fold(*two_batch_estimates(small, big, b_small, b_big), layer=layer)

    # ------------------------------------------------------------------------------------------ read-out
    @property
    def num_updates(self) -> int:
        return self._total.n

    @property
    def grad_sq(self) -> float:
        """‖G‖² estimate (bias-corrected EMA)."""
        return self._total.corrected(self.beta)[0]

    @property
    def trace_cov(self) -> float:
        """tr Σ estimate in per-example units (bias-corrected EMA)."""
        return self._total.corrected(self.beta)[1]

    @property
    def b_simple(self) -> float:
        """B_simple = tr Σ/‖G‖² (McCandlish Eq. 2.9) as a ratio of EMAs; inf if ‖G‖² ≤ 0, nan before data."""
        return self._total.b_simple(self.beta)

    @property
    def sqr(self) -> float:
        """Pollux's ``sqr`` = ‖G‖², clipped at 0."""
        return max(self.grad_sq, 0.0) if self.num_updates else float("nan")

    @property
    def var(self) -> float:
        """Pollux's ``var`` = tr Σ/M0 (gradient variance at the initial batch size), clipped at 1e-6."""
        return max(self.trace_cov / self.init_batch_size, 1e-6) if self.num_updates else float("nan")

    def pollux_params(self) -> tuple[float, float]:
        """(sqr, var) for Pollux's goodput model (statistical efficiency)."""
        return self.sqr, self.var

    def layer_b_simple(self) -> dict[str, float]:
        return {k: e.b_simple(self.beta) for k, e in self._layers.items()}

    def layer_stats(self) -> dict[str, tuple[float, float]]:
        """{layer: (‖G‖², tr Σ)} per layer."""
        return {k: e.corrected(self.beta) for k, e in self._layers.items()}

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Plain floats/ints/strings only, so ``torch.load(weights_only=True)`` accepts it."""
        def ema(e):
            return {"g2": e.g2, "s": e.s, "n": e.n}
        return {"beta": self.beta, "init_batch_size": self.init_batch_size, "skipped": self.skipped,
                "total": ema(self._total), "layers": {k: ema(e) for k, e in self._layers.items()},
                "layer_skipped": dict(self.layer_skipped)}

    def load_state_dict(self, state: dict) -> None:
        try:
            beta, m0 = float(state["beta"]), int(state["init_batch_size"])
            emas = {None: state["total"], **state["layers"]}
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a GNSEstimator state dict (missing {e})") from e
        self.__init__(beta, m0)
        self.skipped = int(state.get("skipped", 0))
        self.layer_skipped = {k: int(v) for k, v in state.get("layer_skipped", {}).items()}
        for k, d in emas.items():
            e = self._total if k is None else self._layers.setdefault(k, _Ema())
            e.g2, e.s, e.n = float(d["g2"]), float(d["s"]), int(d["n"])

    def __repr__(self) -> str:
        return (f"GNSEstimator(b_simple={self.b_simple:.4g}, grad_sq={self.grad_sq:.4g}, "
                f"trace_cov={self.trace_cov:.4g}, updates={self.num_updates}, skipped={self.skipped})")
