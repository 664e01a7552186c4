"""Saxe, McClelland & Ganguli (2014): closed-form learning curves of the decoupled SVD modes.

Time t is in units of τ = 1/η (t = η·steps for GD on L = ½‖Σ31 − W_e‖²). For a depth-N linear net with
balanced, aligned weights, each mode strength u = u_αᵀW_e v_α obeys

    τ du/dt = N·u^{2 − 2/N}·(s − u)                       (Saxe et al. Eq. (8) and its N-layer form)

N = 1 (shallow):  u(t) = s + (u0 − s)·e^{−t}
N = 2:            u(t) = s·e^{2st} / (e^{2st} − 1 + s/u0)   (Saxe et al. Eq. (10))
N ≥ 3: solved numerically (scipy), exactly enough to compare GD against.
"""
from __future__ import annotations

import numpy as np
from scipy.integrate import quad, solve_ivp

__all__ = ["mode_strength", "mode_curves", "time_to", "half_time", "plateau_time"]


def _check(s, u0, depth):
    s = float(s)
    u0 = float(u0)
    if not np.isfinite(s) or s < 0:
        raise ValueError(f"singular value s must be finite and >= 0, got {s!r}")
    if not np.isfinite(u0) or u0 <= 0:
        raise ValueError(f"initial mode strength u0 must be finite and > 0, got {u0!r}")
    if int(depth) != depth or depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    return s, u0, int(depth)


def mode_strength(t, s: float, u0: float, depth: int = 2) -> np.ndarray:
    """u(t) of one mode (t in units of τ); see the module docstring for the equations."""
    s, u0, depth = _check(s, u0, depth)
    t = np.asarray(t, dtype=np.float64)
    if np.any(t < 0):
        raise ValueError("times must be >= 0")
    if depth == 1:
        return s + (u0 - s) * np.exp(-t)
    if depth == 2:
        if s == 0.0:
            return u0 / (1.0 + 2.0 * u0 * t)           # the s → 0 limit of Eq. (10)
        # s·e^{2st}/(e^{2st} − 1 + s/u0), written with e^{−2st} to avoid overflow
        e = np.exp(-2.0 * s * t)
        return s / (1.0 - e + (s / u0) * e)
    # N >= 3: integrate in log u (stiff near the plateau's end), dense output on the requested times
    n = depth

    def rhs(_t, y):
        u = np.exp(y[0])
        return [n * u ** (1.0 - 2.0 / n) * (s - u)]

    tt = np.atleast_1d(t)
    tmax = float(tt.max()) if tt.size else 0.0
    if tmax == 0.0:
        return np.full(t.shape, u0)
    sol = solve_ivp(rhs, (0.0, tmax), [np.log(u0)], method="LSODA", rtol=1e-10, atol=1e-12,
                    dense_output=True)
    if not sol.success:
        raise RuntimeError(f"Saxe ODE integration failed: {sol.message}")
    return np.exp(sol.sol(tt.ravel())[0]).reshape(t.shape)


def mode_curves(t, s, u0, depth: int = 2) -> np.ndarray:
    """Closed-form curves of several modes: shape (len(t), len(s)); ``u0`` scalar or one per mode."""
    s = np.atleast_1d(np.asarray(s, dtype=np.float64))
    u0 = np.broadcast_to(np.asarray(u0, dtype=np.float64), s.shape)
    return np.stack([mode_strength(t, si, ui, depth) for si, ui in zip(s, u0)], axis=-1)


def time_to(u_f: float, s: float, u0: float, depth: int = 2) -> float:
    """Time (units of τ) for a mode to go from u0 to u_f; N = 2: (1/2s)·ln[u_f(s − u0)/(u0(s − u_f))].

    u moves monotonically from u0 towards s (Eq. (1.8)), so u_f must lie between u0 (included) and s
    (excluded); otherwise a ValueError names the three values (the formula would give a negative time)."""
    s, u0, depth = _check(s, u0, depth)
    u_f = float(u_f)
    if u0 < s:
        ok = u0 <= u_f < s
    elif u0 > s:
        ok = s < u_f <= u0
    else:
        ok = u_f == u0
    if not (np.isfinite(u_f) and ok):
        raise ValueError(f"u_f={u_f!r} is not reachable from u0={u0!r}: the mode moves monotonically from u0 "
                         f"towards s={s!r}, so u_f must lie between u0 (included) and s (excluded)")
    if u_f == u0:
        return 0.0
    if depth == 2 and s > 0:
        return float(np.log(u_f * (s - u0) / (u0 * (s - u_f))) / (2.0 * s))
    n = depth
    val, _ = quad(lambda lu: 1.0 / (n * np.exp(lu) ** (1.0 - 2.0 / n) * (s - np.exp(lu))),
                  np.log(u0), np.log(u_f), limit=200)
    return float(val)


def half_time(s: float, u0: float, depth: int = 2) -> float:
    """Time at which u reaches s/2 (N = 2: (1/2s)·ln((s − u0)/u0)); strong modes are learnt first."""
    return time_to(s / 2.0, s, u0, depth)


def plateau_time(s: float, u0: float) -> float:
    """End of the plateau of a two-layer net: the midpoint (1/2s)·ln(s/u0) of the first burst (units of τ;
    theory/01 Eq. (1.12) with u0 ≪ s), s the strongest mode and u0 its starting strength. Saxe's learning
    time (1/s)·ln(s/ε) is the time from ε to s − ε, twice this: by then the mode is fully learnt."""
    s, u0, _ = _check(s, u0, 2)
    if not 0 < u0 < s:
        raise ValueError(f"plateau_time needs 0 < u0 < s, got s={s!r}, u0={u0!r}")
    return float(np.log(s / u0) / (2.0 * s))
