"""The P3 reproduction experiments (papers.md, P3-T1..P3-T6), as functions returning plain numbers.

Each returns a JSON-friendly dict; ``details=True`` adds the task and trajectories (key ``"runs"``) for
plotting. Times are reported in GD steps (τ = 1/η steps). The tests in tests/dynamics/test_p3_claims.py
call these same functions with their defaults; the paper-reproduction registry can too.
"""
from __future__ import annotations

import numpy as np

from .. import saxe
from ..init import aligned_init, random_init
from ..invariants import balancedness_drift, invariant_drift
from ..linearise import activation_masks, exactness_error, mask_change, masked_layer_norms
from ..modes import crossing_times, mode_strengths
from ..phases import detect_phases
from ..tasks import regression_task, saxe_task
from ..train import train

__all__ = ["p3_t1_balancedness", "p3_t2_saxe", "p3_t3_phases", "p3_t4_relu_no_bias", "p3_t5_relu_bias",
           "p3_t6_linearisation", "p3_layer_design", "P3_T1_S"]

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
