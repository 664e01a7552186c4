"""SVD modes of the end-to-end map W_e(t) = W_L···W_1 during training (Saxe et al. 2014, Sec. 2)."""
from __future__ import annotations

import numpy as np

__all__ = ["mode_strengths", "singular_values", "crossing_times"]


def _we(obj):
    return obj.end_to_end() if hasattr(obj, "end_to_end") else np.asarray(obj, dtype=np.float64)


def mode_strengths(traj_or_we, U, V) -> np.ndarray:
    """u_α(t) = u_αᵀ W_e(t) v_α for the teacher's singular vectors; shape (R, m)."""
    we = _we(traj_or_we)
    U = np.asarray(U, dtype=np.float64)
    V = np.asarray(V, dtype=np.float64)
    if we.shape[-2] != U.shape[0] or we.shape[-1] != V.shape[0]:
        raise ValueError(f"W_e has shape {we.shape[-2:]}, U {U.shape}, V {V.shape}: they do not match")
    return np.einsum("ia,rij,ja->ra", U, we, V)


def singular_values(traj_or_we) -> np.ndarray:
    """Singular values of W_e(t), descending; shape (R, min(d_out, d_in))."""
    return np.linalg.svd(_we(traj_or_we), compute_uv=False)


def crossing_times(t, u, level) -> np.ndarray:
    """First time each column of ``u`` (R, m) reaches ``level`` (scalar or one per column), linearly
    interpolated between records; NaN where never reached (used for t_half, P3-T2)."""
    t = np.asarray(t, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    if u.ndim == 1:
        u = u[:, None]
    level = np.broadcast_to(np.asarray(level, dtype=np.float64), (u.shape[1],))
    out = np.full(u.shape[1], np.nan)
    for a in range(u.shape[1]):
        idx = np.flatnonzero(u[:, a] >= level[a])
        if idx.size == 0:
            continue
        k = idx[0]
        if k == 0:
            out[a] = t[0]
        else:
            u0, u1 = u[k - 1, a], u[k, a]
            out[a] = t[k - 1] + (level[a] - u0) / (u1 - u0) * (t[k] - t[k - 1])
    return out
