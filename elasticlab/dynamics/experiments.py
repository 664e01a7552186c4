"""The P3 reproduction experiments (papers.md, P3-T1..P3-T6), as functions returning plain numbers.

Each returns a JSON-friendly dict; ``details=True`` adds the task and trajectories (key ``"runs"``) for
plotting. Times are reported in GD steps (τ = 1/η steps). The tests in tests/dynamics/test_p3_claims.py
call these same functions with their defaults; the paper-reproduction registry can too.
"""
from __future__ import annotations

import numpy as np

from . import saxe
from .init import aligned_init, random_init
from .invariants import balancedness_drift, invariant_drift
from .linearise import activation_masks, exactness_error, mask_change, masked_layer_norms
from .modes import crossing_times, mode_strengths
from .phases import detect_phases
from .tasks import regression_task, saxe_task
from .train import train

__all__ = ["p3_t1_balancedness", "p3_t2_saxe", "p3_t3_phases", "p3_t4_relu_no_bias", "p3_t5_relu_bias",
           "p3_t6_linearisation", "p3_layer_design", "P3_T1_S", "p3_t7_general_linear", "p3_t8_pockets",
           "p3_t9_phase_growth", "P3_T9_CONFIGS"]

P3_T1_S = (5.0, 3.0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0)


def _fl(a):
    return [float(v) for v in np.ravel(a)]


def _linear_run(s, scale, lr, steps, seed, record_every=10):
    task = saxe_task(s, seed=seed)
    d = task.X.shape[1]
    net = random_init((d, d, task.Y.shape[1]), scale, slope=1.0, seed=seed)
    return task, train(net, task.X, task.Y, lr, steps, record_every=record_every)


def p3_t1_balancedness(s=P3_T1_S, scale: float = 1e-3, lr: float = 1e-3, steps: int = 20000, seed: int = 0,
                       details: bool = False) -> dict:
    """P3-T1: a 2-layer linear net (8→8→8) from a small random init keeps W₂ᵀW₂ − W₁W₁ᵀ fixed
    (Arora et al. 2018, Thm. 1) while ‖W_j‖²_F grows by orders of magnitude towards Σ s_α."""
    task, tr = _linear_run(s, scale, lr, steps, seed)
    norms = tr.weight_norms
    diff = norms[:, 1] - norms[:, 0]
    out = {
        "balancedness_drift": float(balancedness_drift(tr).max()),
        "norm_difference_initial": float(diff[0]),
        "norm_difference_final": float(diff[-1]),
        "norm_difference_drift": float(np.abs(diff - diff[0]).max()),
        "norms_initial": _fl(norms[0]),
        "norms_final": _fl(norms[-1]),
        "growth_factor": float((norms[-1] / norms[0]).min()),
        "sum_s": float(np.sum(task.s)),
        "loss_final": float(tr.loss[-1]),
    }
    if details:
        out["runs"] = {"task": task, "trajectory": tr}
    return out


def p3_t2_saxe(s=(4.0, 2.0, 1.0, 0.5, 0.25), d: int = 6, u0: float = 1e-4, lr: float = 1e-3,
               steps: int = 40000, seed: int = 1, random_scale: float = 1e-3, details: bool = False) -> dict:
    """P3-T2: GD from Saxe's balanced aligned start follows u(t) = s·e^{2st}/(e^{2st} − 1 + s/u0)
    (Saxe et al. Eq. (10)); half-times (1/2s)·ln((s − u0)/u0); a random small start keeps the order."""
    task = saxe_task(s, d_in=d, seed=seed)
    nz = task.s > 0
    net = aligned_init(task.U, task.V, u0, depth=2, seed=seed)
    tr = train(net, task.X, task.Y, lr, steps, record_every=10)
    u = mode_strengths(tr, task.U, task.V)
    th = saxe.mode_curves(tr.time, task.s, u0, depth=2)
    rel = np.abs(u - th)[:, nz].max(axis=0) / task.s[nz]
    t_half = crossing_times(tr.steps, u[:, nz], task.s[nz] / 2)
    t_theory = np.array([saxe.half_time(si, u0) / lr for si in task.s[nz]])
    net_r = random_init((d, d, d), random_scale, slope=1.0, seed=seed)
    tr_r = train(net_r, task.X, task.Y, lr, steps, record_every=10)
    t_half_r = crossing_times(tr_r.steps, mode_strengths(tr_r, task.U, task.V)[:, nz], task.s[nz] / 2)
    out = {
        "s": _fl(task.s[nz]),
        "max_rel_error": _fl(rel),
        "t_half_gd": _fl(t_half),
        "t_half_theory": _fl(t_theory),
        "t_half_rel_error": _fl(np.abs(t_half - t_theory) / t_theory),
        "s_times_t_half": _fl(task.s[nz] * t_half),
        "order_follows_s": bool(np.all(np.diff(t_half) > 0)),
        "random_init_t_half": _fl(t_half_r),
        "random_init_s_times_t_half": _fl(task.s[nz] * t_half_r),
        "random_init_order_follows_s": bool(np.all(np.diff(t_half_r) > 0)),
    }
    if details:
        out["runs"] = {"task": task, "trajectory": tr, "random_trajectory": tr_r, "u0": u0}
    return out


def p3_t3_phases(s=P3_T1_S, scale: float = 1e-3, lr: float = 1e-3, steps: int = 20000, seed: int = 0,
                 layer: int = 0, details: bool = False) -> dict:
    """P3-T3: ‖W_j‖²_F of the P3-T1 run shows a plateau, then one growth burst per distinct nonzero
    singular value (Saxe's staircase), then saturation; burst k lasts ~1/s_k and adds ~s_k.

    The plateau time is the first burst's midpoint (1/2s₁)·ln(s₁/u₀) (theory/01 Eq. (1.12)), with u₀ = |u₁(0)|
    the strongest mode's starting strength u₁ᵀW_e(0)v₁ (papers.md P3-T3), not ‖W_j(0)‖²_F."""
    task, tr = _linear_run(s, scale, lr, steps, seed)
    y = tr.weight_norms[:, layer]
    ph = detect_phases(tr.time, y)
    s_nz = np.unique(task.s[task.s > 1e-12])[::-1]
    top = np.flatnonzero(task.s == s_nz[0])
    u = mode_strengths(tr, task.U, task.V)[:, top]
    u0 = float(np.abs(u[0]).max())
    t_plateau = saxe.plateau_time(float(s_nz[0]), u0)            # units of τ
    # near 0 the flow is ȧ = s·b, ḃ = s·a (a = W₁v₁, b = W₂ᵀu₁; theory/01 §1.4), so u = a·b ≈ |a+b|²/4·e^{2st}
    w1, w2 = tr.net.weights_at(tr.params[0])[:2]
    u0_grow = max(float(np.sum((w1 @ task.V[:, a] + w2.T @ task.U[:, a]) ** 2) / 4) for a in top)
    k40 = tr.time <= 0.4 * t_plateau
    out = {
        "n_bursts": ph.n_bursts,
        "n_distinct_modes": int(task.distinct_nonzero),
        "burst_times": _fl(np.array([b.t_peak for b in ph.bursts]) / lr),
        "burst_rises": _fl([b.rise for b in ph.bursts]),
        "s_distinct": _fl(s_nz),
        "plateau_end": ph.plateau_end / lr,
        "saturation_start": ph.saturation_start / lr,
        "u0_top_mode": u0,
        "norm_initial": float(y[0]),
        "plateau_time_theory": t_plateau / lr,
        "plateau_time_growing_mode": saxe.plateau_time(float(s_nz[0]), u0_grow) / lr,
        "top_mode_half_time": float(np.nanmin(crossing_times(tr.time, u, s_nz[0] / 2))) / lr,
        "plateau_growth_fraction": float((y[k40].max() - y[0]) / (y[-1] - y[0])),
    }
    if details:
        out["runs"] = {"task": task, "trajectory": tr, "phases": ph}
    return out


def _relu_run(biases, lr, steps, scale=0.3, widths=(10, 32, 32, 3), seed=0, record_every=10, data_seed=0):
    X, Y = regression_task(d_in=widths[0], d_out=widths[-1], seed=data_seed)
    net = random_init(widths, scale, slope=0.0, biases=biases, seed=seed, fan_in=True)
    return X, Y, train(net, X, Y, lr, steps, record_every=record_every)


def _spread(g):
    g = np.asarray(g)
    return float((g.max() - g.min()) / abs(g.mean()))


def p3_t4_relu_no_bias(lr: float = 1e-2, steps: int = 3000, lrs=(2e-2, 1e-2, 5e-3), scale: float = 0.3,
                       seed: int = 0, details: bool = False) -> dict:
    """P3-T4: a bias-free ReLU MLP (10→32→32→3) grows every ‖W_h‖²_F by the same amount (Du et al. 2018,
    Thm. 2.1). The finite-step drift of ‖W_h‖² − ‖W_{h+1}‖² shrinks ∝ η at a fixed time η·steps."""
    X, Y, tr = _relu_run(False, lr, steps, scale, seed=seed)
    g = tr.growth
    drifts = []
    for eta in lrs:
        _, _, t = _relu_run(False, eta, int(round(lr * steps / eta)), scale, seed=seed, record_every=50)
        drifts.append(float(invariant_drift(t).max()))
    out = {
        "growth": _fl(g),
        "relative_spread": _spread(g),
        "invariant_drift": float(invariant_drift(tr).max()),
        "neuron_invariant_drift": float(invariant_drift(tr, per_neuron=True).max()),
        "lrs": _fl(lrs),
        "invariant_drift_by_lr": drifts,
        "loss_initial": float(tr.loss[0]),
        "loss_final": float(tr.loss[-1]),
    }
    if details:
        out["runs"] = {"X": X, "Y": Y, "trajectory": tr}
    return out


def p3_t5_relu_bias(lr: float = 1e-2, steps: int = 3000, scale: float = 0.3, seed: int = 0,
                    details: bool = False) -> dict:
    """P3-T5: with biases the weight-only growth of the layers differs (symmetry broken), while the
    corrected invariant ‖W_h‖² + ‖b_h‖² − ‖W_{h+1}‖² (bias = incoming weight, Du et al. Thm. 2.1) holds."""
    X, Y, tr = _relu_run(True, lr, steps, scale, seed=seed)
    g = tr.growth
    wn = tr.weight_norms
    weight_only = wn[:, :-1] - wn[:, 1:]
    out = {
        "growth": _fl(g),
        "relative_spread": _spread(g),
        "bias_growth": _fl(tr.bias_norms[-1] - tr.bias_norms[0]),
        "weights_final": _fl(wn[-1]),
        "layer_invariant_drift": float(invariant_drift(tr).max()),
        "neuron_invariant_drift": float(invariant_drift(tr, per_neuron=True).max()),
        "weight_only_invariant_drift": float(np.abs(weight_only - weight_only[0]).max()),
        "loss_initial": float(tr.loss[0]),
        "loss_final": float(tr.loss[-1]),
    }
    if details:
        out["runs"] = {"X": X, "Y": Y, "trajectory": tr}
    return out


def p3_t6_linearisation(lr: float = 1e-2, steps: int = 3000, scale: float = 0.3, seed: int = 0,
                        details: bool = False) -> dict:
    """P3-T6 (exploratory): the mask-linearised net W_eff(x)·x + b_eff(x) reproduces the ReLU net exactly
    at every recorded step; growth of E_x‖D_h(x)W_h‖²_F per layer versus a linear net from the same start.
    E_x‖D_hW_h‖²_F = Σ_i p_i‖W_h[i,:]‖² (p_i: unit i's active fraction), so its spread across layers is built
    in by the masks (theory/02 §2.5); ``active_fraction_*`` report the mean p per hidden layer."""
    out, runs = {}, {}
    for biases in (False, True):
        X, Y, tr = _relu_run(biases, lr, steps, scale, seed=seed, record_every=300)
        key = "bias" if biases else "no_bias"
        err = max(exactness_error(tr.net, X, p) for p in tr.params)
        masked = masked_layer_norms(tr, X)
        out[key] = {
            "exactness_error": float(err),
            "masked_growth": _fl(masked[-1] - masked[0]),
            "weight_growth": _fl(tr.growth),
            "mask_change_final": float(mask_change(tr, X)[-1]),
            "active_fraction_initial": _fl([m.mean() for m in activation_masks(tr.net, X, tr.params[0])]),
            "active_fraction_final": _fl([m.mean() for m in activation_masks(tr.net, X, tr.params[-1])]),
        }
        runs[key] = tr
    X, Y = regression_task(seed=0)
    lin = random_init((10, 32, 32, 3), scale, slope=1.0, seed=seed, fan_in=True)
    tl = train(lin, X, Y, lr, steps, record_every=300)
    out["linear_growth"] = _fl(tl.growth)
    out["linear_relative_spread"] = _spread(tl.growth)
    out["masked_relative_spread"] = _spread(out["no_bias"]["masked_growth"])
    if details:
        runs["linear"] = tl
        runs["X"] = X
        out["runs"] = runs
    return out


def p3_layer_design(s=(4.0, 2.0, 1.0), u0: float = 1e-3, depths=(1, 2, 3, 4, 5), widths=(3, 8, 32),
                    lr: float = 1e-3, horizon: float = 30.0, seed: int = 2, details: bool = False) -> dict:
    """Layer design from first principles (P3's "depth and layer dimension", exploratory).

    Depth: from the same end-to-end start u0, the half-time of each mode follows the N-layer law
    τu' = N·u^{2−2/N}(s − u) (theory/01 Eq. (1.8)); deeper nets sit longer on the plateau when u0 ≪ s, while a
    single layer learns every mode in τ·ln 2. Width: from Saxe's aligned start the dynamics stays in the
    m-dimensional mode subspace, so the mode curves do not depend on the hidden width at all.
    """
    task = saxe_task(s, seed=seed)
    steps = int(round(horizon / lr))
    t_gd, t_th = [], []
    curves = {}
    for n in depths:
        net = aligned_init(task.U, task.V, u0, depth=n, seed=seed)       # width = number of modes
        tr = train(net, task.X, task.Y, lr, steps, record_every=10)
        u = mode_strengths(tr, task.U, task.V)
        t_gd.append(crossing_times(tr.steps, u, task.s / 2))
        t_th.append([saxe.half_time(si, u0, n) / lr for si in task.s])
        curves[n] = (tr.steps, u)
    t_gd, t_th = np.array(t_gd), np.array(t_th)
    ref = None
    width_dev = 0.0
    for w in widths:
        net = aligned_init(task.U, task.V, u0, depth=3, width=w, seed=seed)
        u = mode_strengths(train(net, task.X, task.Y, lr, steps // 3, record_every=50), task.U, task.V)
        ref = u if ref is None else ref
        width_dev = max(width_dev, float(np.abs(u - ref).max()))
    out = {
        "s": _fl(task.s),
        "depths": [int(n) for n in depths],
        "t_half_gd": [_fl(r) for r in t_gd],
        "t_half_theory": [_fl(r) for r in t_th],
        "t_half_rel_error": float(np.nanmax(np.abs(t_gd - t_th) / t_th)),
        "widths": [int(w) for w in widths],
        "width_max_deviation": width_dev,
    }
    if details:
        out["runs"] = {"task": task, "curves": curves}
    return out


# ---- theory/03: general starts, pockets, layer growth per phase (P3-T7..P3-T9) -----------------------------

def _scaled_init(widths, scales, slope, seed, biases=False, positive_first=False):
    """W_j with i.i.d. N(0, scales[j]²) entries (|·| for W_1 with ``positive_first``); biases zero."""
    from .mlp import MLP

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
    from . import general as G
    from .invariants import balancedness

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

    from . import general as G
    from . import pockets as P
    from .invariants import balancedness

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
    from .general import drift_bound
    from .growth import log_rates, phase_growth, phase_intervals

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
