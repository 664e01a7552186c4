"""P5 (McCandlish et al. 2018, App. A.1; Gray et al. 2024, Fig. 2): the two-batch and per-example GNS
estimators on synthetic linear regression with a known B_simple (papers.md P5-T1, P5-T2); the GNS
growing in training (P5-T4), the steps/examples trade-off (P5-T3) and the LayerNorm-GNS proxy (P5-T5).
Experiments: :mod:`elasticlab.gns.experiments`."""

from __future__ import annotations

import contextlib

import numpy as np

from .figures import bars, lines
from .registry import Outcome, reproduction

_NEEDS = ("elasticlab.gns.experiments",)


def _unbiasedness(draws: int, settings=((1, 64), (8, 64), (32, 64)), n: int = 64) -> tuple[dict, dict]:
    """(truth, estimates): mean and standard error over ``draws`` of |G|^2_est and S_est for each two-batch
    setting (:func:`elasticlab.gns.experiments.draw_estimates`, seeds as in its ``unbiasedness``) and for the
    per-example form as the estimator computes it (:func:`elasticlab.gns.per_example_estimates`, the
    Bessel-corrected variance of n per-example gradients)."""
    from elasticlab.gns import per_example_estimates
    from elasticlab.gns.experiments import draw_estimates, linear_regression_population

    g, truth = linear_regression_population()
    pairs = {f"{bs}/{bb}": draw_estimates(g, bs, bb, draws, seed=1 + i)
             for i, (bs, bb) in enumerate(settings)}
    batch = g[np.random.default_rng(len(settings) + 1).integers(0, g.shape[0], size=(draws, n))]
    pairs[f"per-example n={n}"] = per_example_estimates((batch**2).sum(-1).mean(1), n,
                                                         (batch.mean(1) ** 2).sum(-1))
    est = {}
    for k, (g2, s) in pairs.items():
        est[k] = {"grad_sq": float(g2.mean()), "trace_cov": float(s.mean()),
                  "b_simple": float(s.mean() / g2.mean()),
                  "se_grad_sq": float(g2.std(ddof=1) / np.sqrt(draws)),
                  "se_trace_cov": float(s.std(ddof=1) / np.sqrt(draws))}
    return truth, est


@reproduction(
    "P5-T1",
    claim="The two-batch estimators of |G|^2 and tr(Sigma) (McCandlish App. A.1) and their per-example form "
    "are unbiased; B_simple = tr(Sigma)/|G|^2 (Eq. 2.9) is estimated as a ratio of means.",
    target="linear regression D=20, population 2e5 (exact B_simple ~23.2-23.4), 4000 draws: mean estimates "
    "within 2% of the truth for (B_small, B_big) in {(1,64), (8,64), (32,64)} and for the per-example form "
    "(n = 64); B_simple within 3%. Beyond papers.md, as the claim says 'unbiased': every mean within 4 "
    "standard errors of the truth (2% cannot see a missing Bessel factor at n = 64, a 1.6% bias; "
    "4 SE ~ 1.3%)",
    needs=_NEEDS,
)
def p5_t1(quick: bool) -> Outcome:
    draws = 4000
    truth, estimates = _unbiasedness(draws)
    rel = {k: {q: est[q] / truth[q] - 1.0 for q in ("grad_sq", "trace_cov", "b_simple")}
           for k, est in estimates.items()}
    within = all(abs(e["grad_sq"]) < 0.02 and abs(e["trace_cov"]) < 0.02 and abs(e["b_simple"]) < 0.03
                 for e in rel.values())
    z = {k: {q: (est[q] - truth[q]) / est[f"se_{q}"] for q in ("grad_sq", "trace_cov")}
         for k, est in estimates.items()}
    unbiased = all(abs(v) <= 4.0 for e in z.values() for v in e.values())
    labels = [k if k.startswith("per") else f"B_small={k.split('/')[0]}" for k in rel]
    fig = bars(
        labels,
        [est["b_simple"] for est in estimates.values()],
        target=truth["b_simple"],
        target_label=f"true B_simple = {truth['b_simple']:.2f}",
        yaxis="ratio-of-means B_simple",
        title=f"P5-T1: B_simple estimates (B_big = 64, {draws} draws)",
        ok=[abs(e["b_simple"]) < 0.03 for e in rel.values()],
    )
    worst = max(abs(v) for e in rel.values() for v in e.values())
    worst_z = max(abs(v) for e in z.values() for v in e.values())
    b_est = ", ".join(f"{est['b_simple']:.2f}" for est in estimates.values())
    return Outcome(
        {"truth": truth, "draws": draws, "estimates": estimates, "relative_error": rel, "z": z,
         "within_target": within, "within_4se": unbiased},
        within and unbiased,
        f"B_simple {b_est} (true {truth['b_simple']:.2f}); worst rel. error {100 * worst:.1f}%, worst "
        f"|mean - truth| {worst_z:.1f} SE",
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


@contextlib.contextmanager
def _threads(n: int):
    """Run the block with ``n`` torch (and OpenMP) threads, then restore the previous count."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def gns_growth(
    steps: int = 1500,
    batch: int = 64,
    lr: float = 0.1,
    hidden: int = 32,
    beta: float = 0.99,
    window: float = 0.1,
    seed: int = 0,
) -> dict:
    """P5-T4: a small MLP (64 -> hidden -> 10, ReLU) trained by SGD on sklearn's digits. Every step gives
    the per-example estimates of |G|^2 and tr(Sigma) (:func:`elasticlab.gns.per_example_estimates` from
    :class:`~elasticlab.gns.PerSampleGradNorms`); B_simple early and late is the ratio of their means over
    a ``window`` of training centred on 10% and on 90% of the steps (McCandlish App. A.1: a ratio of
    averages, never an average of ratios). The EMA curve of :class:`~elasticlab.gns.GNSEstimator` is
    returned for plotting."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    from elasticlab.gns import GNSEstimator, PerSampleGradNorms, per_example_estimates

    xs, ys = load_digits(return_X_y=True)
    x = torch.tensor(xs / 16.0, dtype=torch.float32)
    y = torch.tensor(ys)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    est = GNSEstimator(beta=beta)
    g2, tr, ema, losses = (np.empty(steps) for _ in range(4))
    # a 64-32-10 MLP: more threads only add synchronisation (30x slower on an oversubscribed machine)
    with _threads(1), PerSampleGradNorms(model) as psn:
        for t in range(steps):
            idx = torch.randint(0, len(x), (batch,), generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            sq = psn.sq_norms().detach().double()
            grad_sq = sum(float(p.grad.pow(2).sum()) for p in model.parameters())
            g2[t], tr[t] = per_example_estimates(float(sq.mean()), batch, grad_sq)
            est.update(sq, grad_sq)
            opt.step()
            ema[t], losses[t] = est.b_simple, loss.item()
    half = max(1, int(window * steps / 2))

    def b_simple_at(frac):
        c = int(frac * steps)
        sl = slice(max(c - half, 0), c + half)
        return float(tr[sl].mean() / g2[sl].mean())

    early, late = b_simple_at(0.1), b_simple_at(0.9)
    return {
        "steps": steps,
        "b_simple_at_10pct": early,
        "b_simple_at_90pct": late,
        "growth": late / early,
        "loss_at_10pct": float(losses[int(0.1 * steps)]),
        "loss_at_90pct": float(losses[int(0.9 * steps)]),
        "b_simple_ema": ema,
        "loss": losses,
    }


@reproduction(
    "P5-T4",
    claim="The gradient noise scale grows as training progresses and the loss falls (McCandlish et al.; "
    "Pollux relies on growth by 10x or more).",
    target="MLP 64-32-10 on sklearn digits, SGD, batch 64: the EMA B_simple (GNSEstimator's ratio of "
    "bias-corrected EMAs) at 90% of training > 2x its value at 10%, as papers.md writes it (the ratio of "
    "means over 10%-of-training windows is reported too)",
    needs=("elasticlab.gns",),
)
def p5_t4(quick: bool) -> Outcome:
    r = gns_growth(steps=600 if quick else 1000)
    bs, loss = r.pop("b_simple_ema"), r.pop("loss")
    bs_arr = np.asarray(bs, dtype=float)
    n = len(bs_arr)
    r["ema_at_10pct"], r["ema_at_90pct"] = float(bs_arr[int(0.1 * n)]), float(bs_arr[int(0.9 * n)])
    r["ema_growth"] = r["ema_at_90pct"] / r["ema_at_10pct"]
    passed = r["ema_growth"] > 2.0
    steps = np.arange(len(bs))
    fig = lines(
        steps,
        {"B_simple (EMA)": bs, "training loss x 100": 100 * loss},
        log_y=True,
        title="P5-T4: the simple noise scale during training (digits MLP)",
        xaxis="SGD step",
        yaxis="B_simple  /  loss x 100",
        vlines=(0.1 * len(bs), 0.9 * len(bs)),
    )
    return Outcome(
        r,
        passed,
        f"EMA B_simple {r['ema_at_10pct']:.1f} -> {r['ema_at_90pct']:.1f} (x{r['ema_growth']:.1f}); window "
        f"means {r['b_simple_at_10pct']:.1f} -> {r['b_simple_at_90pct']:.1f} (x{r['growth']:.1f}); loss "
        f"{r['loss_at_10pct']:.2f} -> {r['loss_at_90pct']:.2f}",
        fig,
    )


@reproduction(
    "P5-T3",
    claim="Steps and examples to reach a target loss trade off as (S/S_min - 1)(E/E_min - 1) = 1 "
    "(McCandlish Eq. 2.11), with B_crit = E_min/S_min (Eq. 2.12) close to the training-averaged B_simple.",
    target="streaming least squares (D=16, H eigenvalues 1 -> 0.1, label noise 0.1), SGD with the LR tuned "
    "on a log grid per batch B in {1, ..., 1024} to 1% of the initial excess loss, as papers.md writes it: "
    "every point's (S/S_min - 1)(E/E_min - 1) within 15% of 1, R^2 > 0.95 in log S for the fit "
    "S = S_min(1 + B_crit/B), and B_crit within 2x of B_simple (GNSEstimator, per-example norms along the "
    "largest batch's run)",
    needs=_NEEDS,
    gap="the product (S/S_min - 1)(E/E_min - 1) is ill-conditioned far from B_crit: at the smallest and "
    "largest batches one factor is near 0 and the other large, so small errors in S_min or E_min (each an "
    "extrapolated asymptote) move it by tens of percent, while the fit S = S_min(1 + B_crit/B) it derives "
    "from holds within a few percent. We believe a 15% band on the product is too tight at the ends of "
    "the batch range; it is judged as written",
)
def p5_t3(quick: bool) -> Outcome:
    from elasticlab.gns.experiments import steps_examples_tradeoff

    if quick:
        r = steps_examples_tradeoff(batches=(1, 4, 16, 64, 256, 1024), n_lrs=24, replicas=16)
    else:
        r = steps_examples_tradeoff(n_lrs=48, replicas=64)
    worst = float(np.max(np.abs(r["ratio_to_fit"] - 1.0)))
    # judged as written (issue 21): every product within 15% of 1. Far from B_crit one factor -> 0, so the
    # product is ill-conditioned there; the distance of each point from the fitted curve is reported too.
    dev = np.abs(np.asarray(r["product"], dtype=float) - 1.0)
    r["product_median_deviation"] = float(np.median(dev))
    r["product_worst_deviation"] = float(np.max(dev))
    ratio = r["crit_over_simple"]
    passed = r["r2_log"] > 0.95 and r["product_worst_deviation"] <= 0.15 and 0.5 <= ratio <= 2.0
    b = np.logspace(-0.5, np.log10(4 * r["batches"][-1]), 200)
    s_fit = r["s_min"] * (1 + r["b_crit"] / b)
    fig = lines(
        None,
        {"measured (S(B), E(B))": (r["examples"], r["steps"]), "fit S_min(1 + B_crit/B)": (b * s_fit, s_fit)},
        dashed=("fit S_min(1 + B_crit/B)",),
        log_x=True,
        log_y=True,
        title=f"P5-T3: steps vs examples to the target loss (B = {int(r['batches'][0])} ... "
        f"{int(r['batches'][-1])})",
        xaxis="examples E",
        yaxis="steps S",
        vlines=(r["e_min"],),
        hlines=((r["s_min"], "S_min"),),
    )
    return Outcome(
        r,
        passed,
        f"(S/S_min-1)(E/E_min-1) = {', '.join(f'{p:.2f}' for p in r['product'])} (worst "
        f"{100 * r['product_worst_deviation']:.0f}% off 1); R^2(log S) {r['r2_log']:.4f}, worst point "
        f"{100 * worst:.1f}% off the fit; B_crit {r['b_crit']:.1f} vs B_simple {r['b_simple']:.1f} "
        f"(x{ratio:.2f})",
        fig,
    )


@reproduction(
    "P5-T5",
    claim="The LayerNorm-only gradient noise scale tracks the total GNS of a transformer over training "
    "(Gray et al. 2024): per-example norms of the normalisation layers suffice.",
    target="char-level transformer (2 layers, d=64, AdamW, stdlib source text), per-example norms of every "
    "parameter (PerSampleGradNorms): Pearson r between the LayerNorm-only and the total EMA B_simple over "
    "training > 0.9",
    needs=("elasticlab.gns",),
)
def p5_t5(quick: bool) -> Outcome:
    from elasticlab.gns.experiments import layernorm_gns_proxy

    # a 114k-parameter model: more threads only add synchronisation on a small or shared machine
    with _threads(1):
        if quick:
            r = layernorm_gns_proxy(steps=120, batch=16, context=32)
        else:
            r = layernorm_gns_proxy(steps=500, batch=32, context=64)
    corr = r["correlation"]["layernorm"]
    passed = corr > 0.9
    total, groups, loss = r.pop("b_simple_total"), r.pop("b_simple_groups"), r.pop("loss")
    skip = r["skip"]
    steps = np.arange(len(total))
    ys = {"total": total[skip:], "LayerNorm only": groups["layernorm"][skip:],
          "Linear only": groups["linear"][skip:], "Embedding only": groups["embedding"][skip:]}
    fig = lines(
        steps[skip:],
        ys,
        log_y=True,
        title=f"P5-T5: EMA B_simple of each layer type over training (r = {corr:.3f})",
        xaxis="AdamW step",
        yaxis="B_simple",
    )
    r["loss_first"], r["loss_last"] = float(loss[:10].mean()), float(loss[-10:].mean())
    r["b_simple_total_end"] = float(total[-1])
    r["b_simple_layernorm_end"] = float(groups["layernorm"][-1])
    return Outcome(
        r,
        passed,
        f"Pearson r(LayerNorm, total) = {corr:.3f} over steps {skip}-{len(total)} "
        f"(Linear {r['correlation']['linear']:.3f}, Embedding {r['correlation']['embedding']:.3f}); "
        f"B_simple at the end {r['b_simple_layernorm_end']:.1f} (LayerNorm) vs {r['b_simple_total_end']:.1f}",
        fig,
    )
