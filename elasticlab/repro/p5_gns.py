"""P5 (McCandlish et al. 2018, App. A.1; Gray et al. 2024, Fig. 2): the two-batch and per-example GNS
estimators on synthetic linear regression with a known B_simple (papers.md P5-T1, P5-T2).
Experiments: :mod:`elasticlab.gns.experiments`."""

from __future__ import annotations

import numpy as np

from .figures import bars, lines
from .registry import Outcome, reproduction

_NEEDS = ("elasticlab.gns.experiments",)


@reproduction(
    "P5-T1",
    claim="The two-batch estimators of |G|^2 and tr(Sigma) (McCandlish App. A.1) and their per-example form "
    "are unbiased; B_simple = tr(Sigma)/|G|^2 (Eq. 2.9) is estimated as a ratio of means.",
    target="linear regression D=20, population 2e5 (exact B_simple ~23.2-23.4): mean estimates "
    "within 2% of the truth for (B_small, B_big) in {(1,64), (8,64), (32,64)}; B_simple within 3%",
    needs=_NEEDS,
)
def p5_t1(quick: bool) -> Outcome:
    from elasticlab.gns.experiments import unbiasedness

    r = unbiasedness(draws=3000)
    truth = r["truth"]
    rel = {}
    for (bs, bb), est in r["settings"].items():
        rel[f"{bs}/{bb}"] = {k: est[k] / truth[k] - 1.0 for k in ("grad_sq", "trace_cov", "b_simple")}
    passed = all(
        abs(e["grad_sq"]) < 0.02 and abs(e["trace_cov"]) < 0.02 and abs(e["b_simple"]) < 0.03
        for e in rel.values()
    )
    labels = [f"B_small={k.split('/')[0]}" for k in rel]
    fig = bars(
        labels,
        [r["settings"][k]["b_simple"] for k in r["settings"]],
        target=truth["b_simple"],
        target_label=f"true B_simple = {truth['b_simple']:.2f}",
        yaxis="ratio-of-means B_simple",
        title="P5-T1: B_simple estimates (B_big = 64, 3000 draws)",
        ok=[abs(e["b_simple"]) < 0.03 for e in rel.values()],
    )
    worst = max(abs(v) for e in rel.values() for v in e.values())
    b_est = ", ".join(f"{est['b_simple']:.2f}" for est in r["settings"].values())
    return Outcome(
        {"truth": truth, "estimates": r["settings"], "relative_error": rel},
        passed,
        f"B_simple {b_est} (true {truth['b_simple']:.2f}); worst rel. error {100 * worst:.1f}%",
        fig,
    )


@reproduction(
    "P5-T2",
    claim="The estimator's variance falls as B_small falls at fixed B_big (Gray et al. 2024, Fig. 2): "
    "per-example norms give the lowest-variance GNS; the |G|^2 estimate is unaffected.",
    target="B_big = 64: std of S_est non-increasing as B_small goes 32 -> 1 (calibrated 20.5 -> 10.9); "
    "std of |G|^2_est flat within +-10%",
    needs=_NEEDS,
)
def p5_t2(quick: bool) -> Outcome:
    from elasticlab.gns.experiments import variance_ordering

    r = variance_ordering(draws=3000)
    bs = sorted(r["std_trace_cov"], reverse=True)
    s_std = np.array([r["std_trace_cov"][b] for b in bs])
    g_std = np.array([r["std_grad_sq"][b] for b in bs])
    monotone = bool(np.all(np.diff(s_std) <= 1e-12))
    flat = float(np.max(np.abs(g_std / g_std.mean() - 1.0)))
    passed = monotone and flat <= 0.10
    fig = lines(
        [str(b) for b in bs],
        {"std of S_est (tr Sigma)": s_std, "std of |G|^2_est x 10": 10 * g_std},
        title="P5-T2: estimator spread against B_small (B_big = 64)",
        xaxis="B_small",
        yaxis="standard deviation over draws",
    )
    return Outcome(
        {
            "b_small": bs,
            "std_trace_cov": s_std,
            "std_grad_sq": g_std,
            "monotone": monotone,
            "grad_sq_std_spread": flat,
        },
        passed,
        f"std S_est {s_std[0]:.1f} -> {s_std[-1]:.1f} "
        f"({'monotone' if monotone else 'NOT monotone'}); "
        f"std |G|^2 within {100 * flat:.1f}%",
        fig,
    )
