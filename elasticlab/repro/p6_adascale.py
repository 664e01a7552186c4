"""P6 (Johnson et al. 2020, AdaScale SGD): gain-ratio identities and scale-invariant training
(papers.md P6-T1, P6-T2). Experiments: :mod:`elasticlab.lr` and :mod:`elasticlab.lr.experiments`."""
from __future__ import annotations

import numpy as np

from .figures import bars, lines
from .registry import Outcome, reproduction


@reproduction(
    "P6-T1",
    claim="AdaScale's gain r = (sigma^2 + mu^2)/(sigma^2/S + mu^2) lies in [1, S] with r(1) = 1, "
          "r -> S in the noise limit and r -> 1 without noise; its worker-gradient estimator is unbiased; "
          "Pollux's efficiency is r(S)/S.",
    target="identities to 1e-12; estimator means within 2% of the true sigma^2, |G|^2; for B_simple = 23.19 "
           "at base batch 1: r = 1.00, 3.56, 9.88, 17.76 at S = 1, 4, 16, 64 (within 1%)",
    needs=("elasticlab.lr", "elasticlab.goodput", "elasticlab.gns.experiments"))
def p6_t1(quick: bool) -> Outcome:
    from elasticlab.gns.experiments import linear_regression_population
    from elasticlab.goodput import efficiency
    from elasticlab.lr import adascale_moments, gain_from_noise_scale, gain_ratio

    scales = np.array([1, 2, 4, 8, 16, 64, 256])
    rng = np.random.default_rng(0)
    sig, mu = rng.uniform(0.01, 100, 50), rng.uniform(0.01, 100, 50)
    r = gain_ratio(sig[:, None], mu[:, None], scales[None, :])
    ident = {
        "r_at_1": float(np.max(np.abs(r[:, 0] - 1))),
        "below_1": float(np.max(np.maximum(1 - r, 0))),
        "above_S": float(np.max(np.maximum(r - scales, 0))),
        "noise_limit": float(np.max(np.abs(gain_ratio(1e12, 1.0, scales) / scales - 1))),
        "noiseless_limit": float(np.max(np.abs(gain_ratio(0.0, 1.0, scales) - 1))),
    }
    phi, m0 = sig / mu, 7.0
    e = efficiency(phi[:, None], m0, m0 * scales[None, :])
    ident["efficiency_is_r_over_S"] = float(np.max(np.abs(e - r / scales)))
    g, truth = linear_regression_population(seed=0)
    calib_S = [1, 4, 16, 64]
    calib = [gain_from_noise_scale(truth["b_simple"], 1, s) for s in calib_S]
    paper = [1.00, 3.56, 9.88, 17.76]
    draws, workers = (1000 if quick else 4000), 8
    idx = np.random.default_rng(1).integers(0, g.shape[0], size=(draws, workers))
    ests = np.array([adascale_moments(g[i]) for i in idx])          # per draw: (sigma2, mu2), batch 1
    est_rel = {"sigma2": float(ests[:, 0].mean() / truth["trace_cov"] - 1),
               "mu2": float(ests[:, 1].mean() / truth["grad_sq"] - 1)}
    tol = 0.02 if not quick else 0.04
    passed = (max(ident.values()) < 1e-12 and all(abs(v) < tol for v in est_rel.values())
              and all(abs(c / p - 1) < 0.01 for c, p in zip(calib, paper)))
    fig = bars([f"S={s}" for s in calib_S], calib, reference=paper, reference_label="papers.md calibration",
               title="P6-T1: AdaScale gain r(S) at B_simple = 23.19, base batch 1", yaxis="gain ratio r")
    return Outcome({"identity_errors": ident, "gain": dict(zip(calib_S, calib)),
                    "estimator_rel_error": est_rel, "draws": draws}, passed,
                   f"r = {', '.join(f'{c:.2f}' for c in calib)}; estimator bias sigma2 "
                   f"{100 * est_rel['sigma2']:+.1f}%, mu2 {100 * est_rel['mu2']:+.1f}%", fig)


@reproduction(
    "P6-T2",
    claim="AdaScale is scale-invariant: with LR r_t * lr(tau) and progress tau += r_t, training reaches the "
          "same loss at every scale S in about T_SI / mean(r) iterations.",
    target="NQM with momentum 0.9, exponential-decay LR, fixed T_SI: final loss within 5% across "
           "S in {1, 4, 16, 64}; loss-vs-tau curves within 10% of S = 1",
    needs=("elasticlab.lr.experiments",))
def p6_t2(quick: bool) -> Outcome:
    from elasticlab.lr.experiments import adascale_run

    scales = (1, 4, 16, 64)
    kw = {"seeds": 4} if quick else {}
    runs = {s: adascale_run(s, **kw) for s in scales}
    finals = np.array([runs[s]["final_loss"] for s in scales])
    spread = float(finals.max() / finals.min() - 1) if np.all(np.isfinite(finals)) else float("inf")
    t_max = min(r["taus"][-1] for r in runs.values())
    grid = np.linspace(0.1 * t_max, t_max, 50)
    ref = np.interp(grid, runs[1]["taus"], runs[1]["losses"])
    gap = {s: float(np.max(np.abs(np.interp(grid, r["taus"], r["losses"]) / ref - 1)))
           for s, r in runs.items()}
    passed = spread <= 0.05 and max(gap.values()) <= 0.10
    fig = lines(None, {f"S={s}": (r["taus"], r["losses"]) for s, r in runs.items()}, log_y=True,
                title="P6-T2: AdaScale loss against scale-invariant progress tau",
                xaxis="tau (iterations at S=1)",
                yaxis="NQM loss")
    return Outcome({"final_loss": {s: runs[s]["final_loss"] for s in scales},
                    "iterations": {s: runs[s]["iterations"] for s in scales},
                    "mean_gain": {s: runs[s]["mean_gain"] for s in scales},
                    "final_spread": spread, "curve_gap": gap}, passed,
                   f"final loss spread {100 * spread:.1f}%, max curve gap {100 * max(gap.values()):.1f}%, "
                   f"iterations {', '.join(str(runs[s]['iterations']) for s in scales)}", fig)
