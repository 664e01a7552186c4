"""P5 (McCandlish et al. 2018, App. A.1; Gray et al. 2024, Fig. 2): the two-batch and per-example GNS
estimators on synthetic linear regression with a known B_simple (papers.md P5-T1, P5-T2).
Experiments: :mod:`elasticlab.gns.experiments`."""

from __future__ import annotations

import contextlib

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
    target="MLP 64-32-10 on sklearn digits, SGD, batch 64: B_simple (ratio of means over 10% of training) "
    "at 90% of training > 2x its value at 10%",
    needs=("elasticlab.gns",),
)
def p5_t4(quick: bool) -> Outcome:
    r = gns_growth(steps=600 if quick else 1000)
    passed = r["growth"] > 2.0
    bs, loss = r.pop("b_simple_ema"), r.pop("loss")
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
        f"B_simple {r['b_simple_at_10pct']:.1f} -> {r['b_simple_at_90pct']:.1f} "
        f"(x{r['growth']:.1f}) while the loss went {r['loss_at_10pct']:.2f} -> "
        f"{r['loss_at_90pct']:.2f}",
        fig,
    )
