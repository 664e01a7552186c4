"""P2-T1/T2 (Dynamic SGD vs the momentum-noise spike after a batch jump, Lin et al. 2019) and P6-T2/T3
(AdaScale's scale invariance, Johnson et al. 2020) on the noisy quadratic model."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..adascale import AdaScale, AdaScaleEstimator, adascale_moments_from_norms
from ..dynamic_sgd import DynamicSGD
from ..nqm import NoisyQuadratic
from ..wrapper import ElasticLR

SPIKE_VARIANTS = ("immediate", "ramp", "none", "immediate_correct", "adascale", "adascale_ramp")


def batch_jump_run(variant="ramp", ramp_steps=None, k=8, dim=1000, seeds=20, steps_before=2000,
                   window=50, lr=0.05, base_batch=8, momentum=0.9, noise=True, seed=0):
    """SGD with momentum on the NQM; the global batch jumps ``base_batch -> k * base_batch`` after
    ``steps_before`` steps. ``variant``: ``"immediate"`` (LR x k at once), ``"ramp"`` (Dynamic SGD over
    ``ramp_steps``, default 8k), ``"none"`` (LR unchanged), ``"immediate_correct"`` (LR x k at once with
    Goyal's momentum correction), ``"adascale"`` / ``"adascale_ramp"`` (AdaScale's gain r from the exact
    NQM statistics, at once / with the Dynamic SGD ramp: papers.md's cross-paper experiment). Returns the
    seed-mean loss curve and
    ``peak_ratio`` = max loss in the ``window`` steps after the jump / mean loss of the ``window`` before,
    ``end_ratio`` = loss at the end of the window / before."""
    if variant not in SPIKE_VARIANTS:
        raise ValueError(f"variant must be one of {SPIKE_VARIANTS}, got {variant!r}")
    if not k > 0:
        raise ValueError(f"batch factor k must be > 0, got {k}")
    gen = torch.Generator().manual_seed(seed)
    nqm = NoisyQuadratic(dim, noise=noise)
    w = torch.nn.Parameter(torch.randn(seeds, dim, generator=gen, dtype=torch.float64))
    opt = torch.optim.SGD([w], lr=lr, momentum=momentum)
    rule = "identity" if variant == "none" else "linear"
    if variant.startswith("adascale"):
        # exact statistics, the seeds pooled as one problem: |G|^2 and tr(Sigma)/M0
        rule = AdaScale(lambda: (float(nqm.grad_sq(w.detach()).sum()), seeds * nqm.trace_cov() / base_batch),
                        base_batch)
    ramp = {"immediate": None, "none": None, "adascale": None, "ramp": DynamicSGD(steps=ramp_steps),
            "adascale_ramp": DynamicSGD(steps=ramp_steps),
            "immediate_correct": DynamicSGD(steps=0, momentum="correct")}[variant]
    elr = ElasticLR(opt, base_batch, rule=rule, ramp=ramp)
    losses = np.empty(steps_before + window)
    for t in range(steps_before + window):
        if t == steps_before:
            elr.on_batch_change(k * base_batch)
        with torch.no_grad():
            w.grad = nqm.grad(w, elr.global_batch, gen)
            elr.step()
            losses[t] = float(nqm.loss(w).mean())
    before = losses[steps_before - window:steps_before].mean()
    after = losses[steps_before:]
    return {"variant": variant, "ramp_steps": None if ramp is None else ramp.length,
            "peak_ratio": float(after.max() / before), "end_ratio": float(after[-1] / before),
            "loss_before": float(before), "losses": losses}


def momentum_spike(k=8, seeds=20, noise=True, ramps=(8, None),
                   variants=("immediate", "immediate_correct", "none"), **kw):
    """P2-T1 (``noise=True``) / P2-T2 (``noise=False``): peak-loss ratios after a k-fold batch jump for
    immediate linear scaling (with and without momentum correction), no LR change, and Dynamic SGD ramps
    of each length in ``ramps`` (``None`` = the default 8k steps). Returns ``{name: peak_ratio}`` plus
    ``{name + "_end": end_ratio}``; ramps are named ``ramp_<T>``."""
    out = {}
    runs = [(v, None) for v in variants] + [("ramp", t) for t in ramps]
    for variant, t in runs:
        r = batch_jump_run(variant, ramp_steps=t, k=k, seeds=seeds, noise=noise, **kw)
        name = variant if variant != "ramp" else f"ramp_{r['ramp_steps']}"
        out[name] = r["peak_ratio"]
        out[name + "_end"] = r["end_ratio"]
    return out


def adascale_run(scale, rule="adascale", t_si=2000, dim=100, seeds=20, lr=0.005, decay=0.5,
                 base_batch=1, momentum=0.9, h_min=1e-3, init="equal", seed=0, oracle=False,
                 final_window=0.05, scale_schedule=None):
    """Train the NQM at scale S (S workers of ``base_batch`` each) until the scale-invariant progress
    reaches ``t_si`` (AdaScale's stopping rule).

    ``rule="adascale"`` takes the gain r from the AdaScale estimator over the S worker gradients
    (``oracle=True``: from the exact sigma^2 and mu^2); ``rule="linear"`` is linear scaling without
    warm-up. LR: ``lr * decay^(tau / t_si)``. ``init="equal"``: w0 = 1/sqrt(h), every coordinate starts
    with loss 1/2 (slow directions matter); ``"ones"``: w0 = 1. ``scale_schedule``: elastic runs,
    ``[(tau_fraction, S), ...]`` switches to S once tau >= tau_fraction * t_si (AdaScale's Elastic runs).
    Returns the final loss (mean over the last ``final_window`` of tau, to average out step-to-step
    noise), iterations, mean gain, and the seed-mean loss after every step against tau."""
    scale = int(scale)
    if scale < 1:
        raise ValueError(f"scale must be an integer >= 1, got {scale}")
    switches = sorted((float(f), int(v)) for f, v in (scale_schedule or ()))
    if any(v < 1 for _, v in switches):
        raise ValueError(f"every scale in scale_schedule must be >= 1, got {scale_schedule}")
    if init not in ("equal", "ones"):
        raise ValueError(f"init must be 'equal' or 'ones', got {init!r}")
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    nqm = NoisyQuadratic(dim, h_min=h_min)
    w0 = torch.ones(seeds, dim, dtype=torch.float64)
    w = torch.nn.Parameter(w0 / nqm.h.sqrt() if init == "equal" else w0)
    opt = torch.optim.SGD([w], lr=lr, momentum=momentum)
    est = AdaScaleEstimator(base_batch)

    def oracle_stats():
        # seeds are independent copies: pool them as one (seeds * dim)-dimensional problem
        return (float(nqm.grad_sq(w.detach()).sum()), seeds * nqm.trace_cov() / base_batch)

    chosen = AdaScale(oracle_stats if oracle else est, base_batch) if rule == "adascale" else rule
    schedule = lambda tau: decay ** (tau / t_si)  # noqa: E731
    elr = ElasticLR(opt, base_batch, rule=chosen, schedule=schedule, global_batch=scale * base_batch)
    taus, losses, gains = [0.0], [float(nqm.loss(w.detach()).mean())], []
    with torch.no_grad():
        while elr.progress.progress < t_si:
            while switches and elr.progress.progress >= switches[0][0] * t_si:
                scale = switches.pop(0)[1]
                elr.on_batch_change(scale * base_batch)
            w.grad, sum_sq = nqm.worker_moments(w, scale, base_batch, rng, gen)
            if scale > 1 and not oracle:
                mean_sq = float((w.grad * w.grad).sum())
                est.update_moments(*adascale_moments_from_norms(sum_sq, mean_sq, scale), scale=scale)
            gains.append(elr.gain())
            elr.step()
            taus.append(elr.progress.progress)
            losses.append(float(nqm.loss(w).mean()))
            if not math.isfinite(losses[-1]) or losses[-1] > 1e6 * losses[0]:
                break  # diverged
    taus, losses = np.array(taus), np.array(losses)
    tail = taus >= (1.0 - final_window) * taus[-1]
    return {"scale": elr.scale, "rule": rule, "final_loss": float(losses[tail].mean()),
            "iterations": elr.steps, "mean_gain": float(np.mean(gains)) if gains else 1.0,
            "taus": taus, "losses": losses}


def adascale_invariance(scales=(1, 4, 16, 64), rule="adascale", **kw):
    """P6-T2: final loss at every S, its spread ``max/min - 1``, the largest relative gap between each
    loss-vs-tau curve and the S = 1 curve (on a common tau grid, ignoring the first 10%), and the curves
    (``runs``: {S: {"taus", "losses"}}). Defaults: ``adascale_run``'s (NQM d=100, h in [1e-3, 1],
    w0 = 1/sqrt(h), lr 0.005 decaying to half over T_SI = 2000, momentum 0.9)."""
    runs = {s: adascale_run(s, rule=rule, **kw) for s in scales}
    finals = np.array([r["final_loss"] for r in runs.values()])
    ref = runs[scales[0]]
    t_max = min(r["taus"][-1] for r in runs.values())
    grid = np.linspace(0.1 * t_max, t_max, 50)
    ref_curve = np.interp(grid, ref["taus"], ref["losses"])
    gaps = {}
    for s, r in runs.items():
        curve = np.interp(grid, r["taus"], r["losses"])
        gaps[s] = float(np.max(np.abs(curve / ref_curve - 1.0)))
    spread = float(finals.max() / finals.min() - 1.0) if np.all(np.isfinite(finals)) else math.inf
    curves = {}
    for s, r in runs.items():  # loss against tau, thinned to <= 500 points per curve for plotting
        idx = np.unique(np.linspace(0, len(r["taus"]) - 1, 500).astype(int))
        curves[s] = {"taus": r["taus"][idx], "losses": r["losses"][idx]}
    return {"final_loss": {s: r["final_loss"] for s, r in runs.items()},
            "iterations": {s: r["iterations"] for s, r in runs.items()},
            "mean_gain": {s: r["mean_gain"] for s, r in runs.items()},
            "final_spread": spread, "max_curve_gap": max(gaps.values()), "curve_gap": gaps,
            "runs": curves}


def elastic_adascale(up=((0.0, 4), (0.25, 8), (0.5, 16)), down=((0.0, 16), (0.25, 8), (0.5, 4)),
                     fixed=(4, 16), **kw):
    """P6-T3: AdaScale with the scale changing during training (S 4 -> 8 -> 16 at T_SI/4 and T_SI/2, and
    back down) against fixed-S runs; returns each run's final loss and iterations and the largest
    relative difference of an elastic run's final loss from the fixed runs' mean."""
    runs = {"elastic_up": adascale_run(up[0][1], scale_schedule=up[1:], **kw),
            "elastic_down": adascale_run(down[0][1], scale_schedule=down[1:], **kw)}
    runs.update({f"fixed_{s}": adascale_run(s, **kw) for s in fixed})
    ref = float(np.mean([runs[f"fixed_{s}"]["final_loss"] for s in fixed]))
    dev = max(abs(runs[k]["final_loss"] / ref - 1.0) for k in ("elastic_up", "elastic_down"))
    return {"final_loss": {k: r["final_loss"] for k, r in runs.items()},
            "iterations": {k: r["iterations"] for k, r in runs.items()},
            "max_deviation": float(dev)}
