"""Pollux's statistical efficiency (Qiao et al., OSDI 2021, Eq. (2)) and the gradient noise scale it reads.

- :func:`efficiency` -- EFFICIENCY_t, ``E(M) = (phi + M0) / (phi + M)``, the one place the formula is written
  (:func:`_efficiency`, unchecked, is what the goodput of :mod:`elasticlab.goodput.function` multiplies by);
- :func:`gain` -- AdaScale's gain ratio, ``S * E(M)``;
- :class:`GradParams`, :func:`noise_scale` -- phi from whatever gradient statistics the caller holds.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import NamedTuple

import numpy as np

__all__ = ["GradParams", "efficiency", "gain", "noise_scale"]


def efficiency(phi, m0, m):
    """Pollux EFFICIENCY_t: ``E(M) = (phi + M0) / (phi + M)``, vectorised over ``phi`` and ``m``.

    ``phi`` is the (pre-conditioned) gradient noise scale tr(Sigma)/|G|^2 (McCandlish's B_simple);
    ``phi = inf`` (pure noise) gives 1 for every M. E(M0) = 1 and E < 1 for M > M0.
    """
    phi = _floats("phi (gradient noise scale)", phi)
    m = _floats("m (batch size)", m)
    if np.any(phi < 0) or np.any(np.isnan(phi)):
        raise ValueError(f"phi (gradient noise scale) must be >= 0, got {phi}")
    _check_positive("m0 (initial batch size)", m0)
    _check_positive("m (batch size)", m)
    out = _efficiency(phi, m0, m)
    return out if out.ndim else float(out)


def _efficiency(phi, m0, m):
    """E(M) without input checks, for callers that checked once (the goodput's candidate grid). Outside
    the domain (M = 0 with phi = 0: an allocation of zero GPUs) it gives inf or nan, as IEEE division
    does, without numpy's divide-by-zero warnings."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return _efficiency_formula(phi, m0, m)


def _efficiency_formula(phi, m0, m):
    """``E(M) = (phi + M0) / (phi + M)`` as arithmetic only, for numpy arrays and for the numba kernel of
    :mod:`elasticlab.goodput._best` alike (the same IEEE operations in the same order)."""
    # written as 1 - (M - M0) / (phi + M) so that phi = inf gives exactly 1
    return 1.0 - (m - m0) / (phi + m)


def gain(phi, m0, m):
    """AdaScale's gain ratio r at scale S = M/M0 (Johnson et al. 2020), = S * E(M) in Pollux's terms."""
    return efficiency(phi, m0, m) * (np.asarray(m, dtype=float) / m0)


class GradParams(NamedTuple):
    """Pollux's gradient statistics: ``sqr`` ~ |G|^2 and ``var`` ~ tr(Sigma)/M0 (the variance at the
    initial batch), so phi = M0 * var / sqr."""

    sqr: float
    var: float

    @classmethod
    def from_gns(cls, phi, init_batch) -> GradParams:
        """The (sqr, var) pair with |G|^2 = 1 that has noise scale ``phi`` at initial batch ``init_batch``."""
        phi = noise_scale(phi)
        _check_positive("init_batch", init_batch)
        return cls(1.0, phi / float(init_batch))


def noise_scale(stats, init_batch=None) -> float:
    """The gradient noise scale phi = tr(Sigma)/|G|^2 from whatever the caller holds.

    Accepts a number (phi itself, must be >= 0), a pair ``(sqr, var)`` in Pollux's convention
    (``var`` = gradient variance at the initial batch, so phi = M0 * var / sqr), or an object with, in
    order of preference, ``b_simple``; ``grad_sq`` and ``trace_cov``; or ``sqr`` and ``var``
    (e.g. :class:`elasticlab.gns.GNSEstimator`). Estimates are clipped like Pollux's readout
    (|G|^2 >= 0, variance >= 0), so a noisy negative estimate gives phi = 0 or inf, never an error.
    """
    if isinstance(stats, Real) or (isinstance(stats, np.ndarray) and stats.ndim == 0):
        phi = float(stats)
        if not phi >= 0:
            raise ValueError(f"phi (gradient noise scale) must be >= 0, got {phi}")
        return phi
    if isinstance(stats, tuple) and len(stats) == 2:
        return _phi_from_sqr_var(stats[0], stats[1], init_batch)
    b_simple = _attr(stats, "b_simple")
    if b_simple is not None:
        return max(float(b_simple), 0.0) if not math.isnan(float(b_simple)) else _nan_stats(stats)
    grad_sq, trace_cov = _attr(stats, "grad_sq"), _attr(stats, "trace_cov")
    if grad_sq is not None and trace_cov is not None:
        return _ratio(max(float(trace_cov), 0.0), max(float(grad_sq), 0.0))
    sqr, var = _attr(stats, "sqr"), _attr(stats, "var")
    if sqr is not None and var is not None:
        return _phi_from_sqr_var(sqr, var, init_batch)
    raise TypeError(
        f"cannot read a gradient noise scale from {stats!r}: pass phi, (sqr, var), or an object with "
        "b_simple, grad_sq/trace_cov or sqr/var"
    )


def _attr(obj, name):
    value = getattr(obj, name, None)
    if callable(value):
        value = value()
    if value is None:
        return None
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    return float(value)


def _phi_from_sqr_var(sqr, var, init_batch):
    if init_batch is None:
        raise ValueError("(sqr, var) statistics need init_batch: var is the variance at the initial batch")
    sqr, var = float(sqr), float(var)
    if math.isnan(sqr) or math.isnan(var):
        raise ValueError(f"gradient statistics are NaN: sqr={sqr}, var={var}")
    return _ratio(float(init_batch) * max(var, 0.0), max(sqr, 0.0))


def _ratio(num, den):
    if den > 0:
        return num / den
    return math.inf if num > 0 else 0.0


def _nan_stats(stats):
    raise ValueError(f"gradient statistics of {stats!r} are NaN")


def _floats(name, value) -> np.ndarray:
    """``value`` as a float array; a ValueError naming ``name`` when it is not numbers."""
    try:
        return np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number or an array of numbers, got {value!r:.80}") from None


def _check_positive(name, value):
    if type(value) in (int, float):  # a Python number: no array to build (the simulator's agents, per call)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
        return
    arr = _floats(name, value)
    if np.any(~(arr > 0)):
        raise ValueError(f"{name} must be > 0, got {value}")
