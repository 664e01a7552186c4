"""Layer growth per phase of learning (theory/03 §3.3).

``phase_intervals`` turns :func:`~elasticlab.dynamics.phases.detect_phases` into plateau / burst / saturation
intervals; ``phase_growth`` reports, per phase and layer, the growth Δ‖W_j‖²_F, the relative growth
Δ ln‖W_j‖²_F and its mean rate (units 1/τ), the prediction ln(1 + g/n_j(t_a)) of Eq. (3.2) from one
layer's growth g, the bias growth and the loss drop (for the GD bound (3.3)).
``log_rates``: d ln‖W_j‖²/dt between records.
"""
from __future__ import annotations

import numpy as np

from .phases import detect_phases

__all__ = ["PHASES", "phase_intervals", "phase_growth", "log_rates"]

PHASES = ("plateau", "burst", "saturation")


def phase_intervals(t, y, **kw) -> dict:
    """{phase: (t_a, t_b)} from the curve y(t): plateau [t_0, plateau_end], burst [plateau_end,
    saturation_start], saturation [saturation_start, t_end]; empty phases are left out."""
    ph = detect_phases(t, y, **kw)
    t = np.asarray(t, dtype=np.float64)
    edges = {"plateau": (float(t[0]), ph.plateau_end), "burst": (ph.plateau_end, ph.saturation_start),
             "saturation": (ph.saturation_start, float(t[-1]))}
    return {k: v for k, v in edges.items() if v[1] > v[0]}


def log_rates(traj) -> tuple:
    """(midpoint times, d ln‖W_j‖²/dt between consecutive records (R−1, L)), times in units of τ."""
    t = traj.time
    ln = np.log(traj.weight_norms)
    return 0.5 * (t[1:] + t[:-1]), np.diff(ln, axis=0) / np.diff(t)[:, None]


def phase_growth(traj, intervals=None, ref_layer: int = 0, pred_layer: int = -1) -> dict:
    """Per phase: indices, times, growth, log growth, mean log rate, predicted log growth, bias growth,
    loss drop. Phases from ``ref_layer``'s norm unless ``intervals`` are given."""
    t = traj.time
    n = traj.weight_norms
    if intervals is None:
        intervals = phase_intervals(t, n[:, ref_layer])
    bn = traj.bias_norms
    out = {}
    for name, (ta, tb) in intervals.items():
        a = int(np.argmin(np.abs(t - ta)))
        b = int(np.argmin(np.abs(t - tb)))
        if b <= a:
            continue
        g = n[b] - n[a]
        lg = np.log(n[b] / n[a])
        out[name] = {
            "t_start": float(t[a]), "t_end": float(t[b]),
            "growth": g, "log_growth": lg, "mean_log_rate": lg / (t[b] - t[a]),
            "predicted_log_growth": np.log1p(g[pred_layer] / n[a]),
            "bias_growth": bn[b] - bn[a], "loss_drop": float(traj.loss[a] - traj.loss[b]),
            "norms_start": n[a],
        }
    return out
