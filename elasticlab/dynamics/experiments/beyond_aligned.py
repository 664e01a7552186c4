"""P3-T7..P3-T9 (theory/03): general (non-aligned, unbalanced) linear starts, pockets of the data space
where a ReLU net is linear, and layer growth per phase."""
from __future__ import annotations

import numpy as np

from ..init import random_init
from ..tasks import saxe_task
from ..train import train
from .aligned_and_relu import P3_T1_S, _fl, _linear_run, _relu_run

__all__ = ["p3_t7_general_linear", "p3_t8_pockets", "p3_t9_phase_growth", "P3_T9_CONFIGS"]

# ---- theory/03: general starts, pockets, layer growth per phase (P3-T7..P3-T9) -----------------------------

def _scaled_init(widths, scales, slope, seed, biases=False, positive_first=False):
    """W_j with i.i.d. N(0, scales[j]²) entries (|·| for W_1 with ``positive_first``); biases zero."""
    from ..mlp import MLP

    net = MLP(widths, slope=slope, has_bias=biases)
    rng = np.random.default_rng(seed)
    for j, w in enumerate(net.weights):
        w[...] = rng.standard_normal(w.shape) * scales[j]
        if positive_first and j == 0:
            w[...] = np.abs(w)
    return net


def p3_t7_general_linear(s=P3_T1_S, widths=(8, 16, 16, 8), scales=(0.05, 0.01, 0.02), lr: float = 5e-3,
                         steps: int = 12000, seed: int = 0, details: bool = False) -> dict:
    """P3-T7: a linear net from an unbalanced, non-aligned start (theory/03 §3.1): common rate (3.1),
    GD bound (3.3), Weyl (3.4), Davis–Kahan (3.5), relative imbalance ‖C_j(0)‖_F/‖W_jW_jᵀ(t)‖_F."""
    from .. import general as G
    from ..invariants import balancedness

    task = saxe_task(s, seed=seed)
    net = _scaled_init(widths, scales, 1.0, seed)
    tr = train(net, task.X, task.Y, lr, steps, record_every=20)
    rates = np.array([G.flow_rates(tr.net, task.X, task.Y, p) for p in tr.params])
    common = np.array([G.common_rate(tr.net, task.X, task.Y, p) for p in tr.params])
    scale = np.maximum(np.abs(common), 1e-300)
    rate_err = float(np.max(np.abs(rates - common[:, None]) / scale[:, None]))
    n = tr.weight_norms
    g = n - n[0]
    bounds = np.array([G.drift_bound(lr, tr.loss[0], v) for v in tr.loss])
    gdiff = g.max(axis=1) - g.min(axis=1)
    cs = balancedness(tr.weights)
    c0_2 = np.array([np.linalg.norm(c[0], 2) for c in cs])
    c0_f = np.array([np.linalg.norm(c[0]) for c in cs])
    ct_2 = np.stack([np.linalg.norm(c, ord=2, axis=(1, 2)) for c in cs], axis=1)
    gap = G.adjacent_sv_gap(tr)
    sin = G.alignment_sin(tr)
    dk_end = G.davis_kahan_bound(tr, c_norm=c0_2)[-1]
    rho = G.relative_imbalance(tr)
    wwt_end = np.array([np.linalg.norm(w[-1] @ w[-1].T) for w in tr.weights[:-1]])
    out = {
        "rate_rel_error": rate_err,
        "growth_final": _fl(g[-1]),
        "growth_spread_final": float(gdiff[-1] / abs(g[-1].mean())),
        "growth_difference_max": float(gdiff.max()),
        "growth_difference_over_bound": float(np.max(gdiff[1:] / bounds[1:])),
        "norms_initial": _fl(n[0]),
        "log_rate_ratio_initial": float(n[0].max() / n[0].min()),
        "c_norm_initial": _fl(c0_2),
        "c_norm_max_over_initial": _fl(ct_2.max(axis=0) / c0_2),
        "weyl_gap_max": _fl(gap.max(axis=0)),
        "weyl_ok": bool(np.all(gap <= ct_2 * (1 + 1e-9) + 1e-12)),
        "sin_initial": _fl(sin[0]),
        "sin_final": _fl(sin[-1]),
        "davis_kahan_final": _fl(dk_end),
        "rho_initial": _fl(rho[0]),
        "rho_final": _fl(rho[-1]),
        "rho_final_predicted": _fl(c0_f / wwt_end),
        "loss_initial": float(tr.loss[0]),
        "loss_final": float(tr.loss[-1]),
    }
    if details:
        out["runs"] = {"task": task, "trajectory": tr}
    return out


def p3_t8_pockets(details: bool = False) -> dict:
    """P3-T8: how long a ReLU net's masks stay fixed (theory/03 Eq. (3.7)), and inside a one-pocket window
    the ReLU net *is* the linear net of its active units ((3.6); set-ups A and B of theory/03 §3.2)."""
    from scipy.stats import spearmanr

    from .. import general as G
    from .. import pockets as P
    from ..invariants import balancedness

    # (A) the P3-T4 net, every step recorded
    lr_a = 1e-2
    X, Y, tr = _relu_run(False, lr_a, 3000, 0.3, seed=0, record_every=1)
    t_hat = P.flip_estimate(tr.net, X, Y, tr.params[0]) / lr_a          # steps
    t_meas = P.first_flips(tr, X)
    cap = float(tr.steps[-1]) + 1.0
    rho_s = float(spearmanr(np.minimum(t_hat, 10 * cap), np.minimum(t_meas, 10 * cap)).statistic)
    both = np.isfinite(t_hat) & np.isfinite(t_meas)
    ratio = t_meas[both] / t_hat[both]
    a = {
        "spearman": rho_s,
        "median_ratio": float(np.median(ratio)),
        "n_examples": int(len(t_meas)),
        "n_flipped": int(np.isfinite(t_meas).sum()),
        "n_estimated": int(np.isfinite(t_hat).sum()),
        "median_first_flip_steps": float(np.median(t_meas[np.isfinite(t_meas)])),
        "window_steps": float(np.min(t_meas)),
        "window_estimate_steps": float(np.min(t_hat)),
        "examples_flipped_fraction": float(np.mean(t_meas <= tr.steps[-1])),
    }
    # (B) one pocket: Saxe's inputs √d·e_μ, W_1 ≥ 0 at the start
    lr_b, steps_b = 5e-3, 4000
    task = saxe_task(P3_T1_S, seed=0)
    relu = _scaled_init((8, 16, 8), (0.1, 0.1), 0.0, 0, positive_first=True)
    lin = _scaled_init((8, 16, 8), (0.1, 0.1), 1.0, 0, positive_first=True)
    tr_r = train(relu, task.X, task.Y, lr_b, steps_b, record_every=1)
    tr_l = train(lin, task.X, task.Y, lr_b, steps_b, record_every=1)
    w1 = tr_r.weights[0]
    neg = np.flatnonzero((w1 <= 0).any(axis=(1, 2)))
    k_w = int(neg[0]) if neg.size else len(tr_r.steps)          # first record outside the pocket
    inside = slice(0, k_w)
    diff = np.abs(tr_r.params - tr_l.params).max(axis=1)
    c = balancedness(tr_r.weights)[0]
    c_drift = float(np.abs(c[inside] - c[0]).max())
    bound = G.drift_bound(lr_b, tr_r.loss[0], tr_r.loss[k_w - 1])
    t_hat_b = float(P.flip_estimate(relu, task.X, task.Y).min() / lr_b)
    per_example = P.first_flips(tr_r, task.X)
    b = {
        "window_steps": float(tr_r.steps[k_w]) if k_w < len(tr_r.steps) else float("inf"),
        "window_estimate_steps": t_hat_b,
        "window_ratio": (float(tr_r.steps[k_w]) / t_hat_b) if k_w < len(tr_r.steps) else float("inf"),
        "per_example_first_flip_steps": _fl(per_example),
        "relu_vs_linear_inside": float(diff[inside].max()),
        "relu_vs_linear_final": float(diff[-1]),
        "c_drift_inside": c_drift,
        "c_drift_bound": bound,
        "loss_at_window": float(tr_r.loss[max(k_w - 1, 0)]),
        "loss_initial": float(tr_r.loss[0]),
        "loss_final_relu": float(tr_r.loss[-1]),
        "loss_final_linear": float(tr_l.loss[-1]),
    }
    out = {"A": a, "B": b}
    if details:
        out["runs"] = {"A": (X, Y, tr, t_hat, t_meas), "B": (task, tr_r, tr_l, k_w)}
    return out


P3_T9_CONFIGS = tuple((act, depth, width) for act in ("linear", "relu", "relu_bias") for depth in (2, 3, 4)
                      for width in (8, 32))


def p3_t9_phase_growth(configs=P3_T9_CONFIGS, scale: float = 0.1, lr: float = 5e-3, steps: int = 8000,
                       seed: int = 0, details: bool = False) -> dict:
    """P3-T9: per phase (plateau, burst, saturation) and layer, growth and relative growth d ln‖W_j‖²/dt for
    linear, bias-free ReLU and ReLU-with-bias nets of depths 2-4 and widths 8, 32 (theory/03 §3.3); plus the
    N = 2 small-start peak of d ln‖W_1‖²/dt (Eq. (3.8)) on the P3-T1 run."""
    from ..general import drift_bound
    from ..growth import log_rates, phase_growth, phase_intervals

    task = saxe_task(P3_T1_S, seed=seed, symmetric=True)
    d = task.X.shape[1]
    rows, runs = [], {}
    for act, depth, width in configs:
        widths = (d,) + (width,) * (depth - 1) + (d,)
        net = random_init(widths, scale, slope=1.0 if act == "linear" else 0.0, biases=act == "relu_bias",
                          seed=seed)
        tr = train(net, task.X, task.Y, lr, steps, record_every=10)
        iv = phase_intervals(tr.time, tr.weight_norms[:, 0])
        pg = phase_growth(tr, iv)
        tm, lrate = log_rates(tr)
        k = int(np.argmax(lrate[:, 0]))
        row = {"activation": act, "depth": depth, "width": width, "norms_initial": _fl(tr.weight_norms[0]),
               "peak_log_rate": float(lrate[k, 0]), "peak_log_rate_time": float(tm[k]), "phases": {}}
        for name, ph in pg.items():
            bnd = drift_bound(lr, ph["loss_drop"], 0.0)
            g = ph["growth"]
            ent = {"t_start": ph["t_start"], "t_end": ph["t_end"], "growth": _fl(g),
                   "mean_log_rate": _fl(ph["mean_log_rate"]), "bound": bnd,
                   "growth_difference": float(g.max() - g.min()),
                   "loss_rises": int(np.sum(np.diff(tr.loss[(tr.time >= ph["t_start"])
                                                            & (tr.time <= ph["t_end"])]) > 0))}
            if act == "relu_bias":
                bg = ph["bias_growth"]
                ent["bias_identity_error"] = float(np.max(np.abs(g[1:] - g[:-1] - bg[:-1])))
                ent["bias_growth"] = _fl(bg)
            else:
                lg, pl = ph["log_growth"], ph["predicted_log_growth"]
                ent["log_growth"] = _fl(lg)
                ent["log_growth_error"] = float(np.max(np.abs(lg - pl)))
                ent["log_growth_ok"] = bool(np.all(np.abs(lg - pl) <= np.maximum(0.01 * np.abs(pl), 1e-4)))
                ent["order_inverse_to_norm"] = bool(np.all(np.diff(np.abs(lg)[np.argsort(ph["norms_start"])])
                                                           <= 1e-12))
            row["phases"][name] = ent
        rows.append(row)
        runs[(act, depth, width)] = tr
    # N = 2 from a small start (P3-T1 run): peak of d ln‖W_1‖²/dt on the plateau, ≈ 2 s_max
    _, t1 = _linear_run(P3_T1_S, 1e-3, 1e-3, 20000, 0)
    iv1 = phase_intervals(t1.time, t1.weight_norms[:, 0])
    tm1, lr1 = log_rates(t1)
    k1 = int(np.argmax(lr1[:, 0]))
    out = {"configs": rows,
           "small_start_n2": {"peak_log_rate": float(lr1[k1, 0]), "peak_time": float(tm1[k1]),
                              "plateau_end": float(iv1["plateau"][1]), "two_s_max": 2 * max(P3_T1_S)}}
    if details:
        out["runs"] = {"task": task, "trajectories": runs, "small_start": t1}
    return out
