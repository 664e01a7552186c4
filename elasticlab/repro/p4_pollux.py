"""P4 (Qiao et al., Pollux, OSDI 2021): statistical efficiency, the throughput-model fit, the agent's
batch-size choice and the scheduler's fairness knob (papers.md P4-T1..P4-T4).

``elasticlab.goodput`` has no experiments module, so the small experiments live here, built only on its
public API (:func:`efficiency`, :class:`ThroughputModel`, :func:`fit_throughput_model`,
:class:`GoodputFunction`, :func:`fitness`); each is a plain function returning numbers.
"""

from __future__ import annotations

import numpy as np

from .figures import bars, lines
from .registry import Outcome, reproduction

#: theta_sys of papers.md P4-T2.
TRUE_THETA = dict(
    alpha_grad=0.05,
    beta_grad=2e-3,
    alpha_local=0.02,
    beta_local=1e-3,
    alpha_node=0.1,
    beta_node=5e-3,
    gamma=2.0,
)


def efficiency_identities(phis=(0.0, 1.0, 30.0, 1e3, 1e6), m0: float = 32.0) -> dict:
    """P4-T1: max errors of E(M0) = 1, monotone decrease in M, E = r(M/M0)/(M/M0) (AdaScale gain),
    E -> 1 as phi -> inf, and E(phi + 2 M0) = 1/2 (Pollux Eq. (2))."""
    from elasticlab.goodput import efficiency
    from elasticlab.lr import gain_ratio

    m = m0 * np.geomspace(1, 1024, 200)
    out = {"E(M0)=1": 0.0, "increase_in_M": 0.0, "E=r/S": 0.0, "half_at_phi+2M0": 0.0}
    for phi in phis:
        e = efficiency(phi, m0, m)
        out["E(M0)=1"] = max(out["E(M0)=1"], abs(efficiency(phi, m0, m0) - 1))
        out["increase_in_M"] = max(out["increase_in_M"], float(np.max(np.diff(e), initial=0.0)))
        r = gain_ratio(phi / m0, 1.0, m / m0)  # sigma^2/mu^2 = phi/M0 at the base batch
        out["E=r/S"] = max(out["E=r/S"], float(np.max(np.abs(e - r / (m / m0)))))
        if phi > 0:
            out["half_at_phi+2M0"] = max(out["half_at_phi+2M0"], abs(efficiency(phi, m0, phi + 2 * m0) - 0.5))
    out["E(inf)-1"] = float(np.max(np.abs(efficiency(np.inf, m0, m) - 1)))
    return out


def throughput_fit(noise: float = 0.05, seed: int = 0, holdout: float = 0.3, theta=None) -> dict:
    """P4-T2: step and sync times from a known theta_sys on K in {1,2,4,8,16} GPUs over 1/2/4 nodes
    (<= 4 GPUs per node) and per-GPU batches 16..256, with ``noise`` log-normal noise; fit T_iter alone on
    ``1 - holdout`` of the configurations (RMSLE, L-BFGS-B), predict the rest."""
    from elasticlab.goodput import ThroughputModel, fit_throughput_model

    truth = ThroughputModel(**(theta or TRUE_THETA))
    rows = [
        (n, k, b)
        for k in (1, 2, 4, 8, 16)
        for n in (1, 2, 4)
        for b in (16, 32, 64, 128, 256)
        if n <= k <= 4 * n and (k > 1 or n == 1)
    ]
    cfg = np.array(rows, dtype=float)
    rng = np.random.default_rng(seed)
    t_true = truth.iter_time(cfg[:, 0], cfg[:, 1], cfg[:, 2])
    t_obs = t_true * np.exp(noise * rng.standard_normal(len(cfg)))
    test = rng.random(len(cfg)) < holdout
    obs = np.column_stack([cfg[:, 0], cfg[:, 1], cfg[:, 2], np.zeros(len(cfg)), t_obs])  # T_iter only
    fitted = fit_throughput_model(obs[~test])
    pred = fitted.iter_time(cfg[test, 0], cfg[test, 1], cfg[test, 2])
    err_obs = np.abs(pred / t_obs[test] - 1)
    err_true = np.abs(pred / t_true[test] - 1)
    # the overlap limits of Eq. (6): gamma = 1 adds, large gamma tends to the max
    g1 = ThroughputModel(**{**TRUE_THETA, "gamma": 1.0})
    g10 = ThroughputModel(**{**TRUE_THETA, "gamma": 10.0})
    a, c = g1.grad_time(cfg[:, 2]), g1.sync_time(cfg[:, 0], cfg[:, 1])
    lim1 = float(np.max(np.abs(g1.iter_time(cfg[:, 0], cfg[:, 1], cfg[:, 2]) - (a + c))))
    ratio10 = g10.iter_time(cfg[:, 0], cfg[:, 1], cfg[:, 2]) / np.maximum(a, c)
    return {
        "n_train": int((~test).sum()),
        "n_test": int(test.sum()),
        "heldout_mean_error": float(err_obs.mean()),
        "heldout_mean_error_vs_truth": float(err_true.mean()),
        "heldout_max_error": float(err_obs.max()),
        "fitted": fitted.as_dict(),
        "true": truth.as_dict(),
        "gamma1_sum_error": lim1,
        "gamma10_over_max": [float(ratio10.min()), float(ratio10.max())],
        "pred": pred.tolist(),
        "obs": t_obs[test].tolist(),
    }


def batch_choice(
    phis=(1e-3, 10.0, 100.0, 1e3, 1e4, 1e5),
    gpus=(1, 2, 4, 8, 16),
    m0: int = 32,
    max_batch: int = 8192,
    max_per_gpu_batch: int = 256,
    gpus_per_node: int = 4,
) -> dict:
    """P4-T3: the agent's goodput-optimal global batch M* = K b (s + 1) on a (phi, K) grid (Pollux §4.1),
    with the P4-T2 theta_sys; nodes = ceil(K / gpus_per_node). (Far above M*, phi >> M, goodput is
    throughput-bound and nearly flat in M, and the forced accumulation step on one GPU can then reverse
    the order of K = 1 and K = 2: e.g. phi = 1e5 gives M* = 762 on one GPU and 484 on two.)"""
    from elasticlab.goodput import GoodputFunction, ThroughputModel

    model = ThroughputModel(**TRUE_THETA)
    best = np.zeros((len(phis), len(gpus)))
    for i, phi in enumerate(phis):
        fn = GoodputFunction(model, float(phi), m0)
        k = np.array(gpus, dtype=float)
        n = np.ceil(k / gpus_per_node)
        _, b, s = fn.optimize(n, k, max_batch=max_batch, max_per_gpu_batch=max_per_gpu_batch)
        best[i] = k * b * (s + 1)
    return {
        "phis": list(phis),
        "gpus": list(gpus),
        "m0": m0,
        "best_batch": best.tolist(),
        "monotone_in_phi": bool(np.all(np.diff(best, axis=0) >= 0)),
        "monotone_in_gpus": bool(np.all(np.diff(best, axis=1) >= 0)),
        "small_phi_one_gpu": float(best[0, 0]),
    }


def fairness_knob(
    jobs: int = 12, trials: int = 200, ps=(-100.0, -10.0, -3.0, -1.0, 0.0, 0.5, 1.0, 2.0), seed: int = 0
) -> dict:
    """P4-T4: on random speedup vectors, FITNESS_1 = mean, FITNESS_p -> min as p -> -inf, and FITNESS_p is
    non-decreasing in p (power-mean inequality; Pollux Eq. (9))."""
    from elasticlab.goodput import fitness

    rng = np.random.default_rng(seed)
    x = rng.uniform(0.05, 16.0, (trials, jobs))
    vals = np.stack([fitness(x, p=p, axis=1) for p in ps], axis=1)  # (trials, len(ps))
    mean_err = float(np.max(np.abs(fitness(x, p=1.0, axis=1) / x.mean(1) - 1)))
    # min <= F_p <= J^(-1/p) min for p < 0, so F_-100 is within J^(1/100) - 1 (2.5% for 12 jobs) of the min
    min_err = float(np.max(np.abs(fitness(x, p=-100.0, axis=1) / x.min(1) - 1)))
    exact_min = float(np.max(np.abs(fitness(x, p=-np.inf, axis=1) - x.min(1))))
    worst_drop = float(np.max(vals[:, :-1] - vals[:, 1:]))
    return {
        "ps": list(ps),
        "mean_curve": vals.mean(0).tolist(),
        "p1_vs_mean": mean_err,
        "p-100_vs_min": min_err,
        "p-100_bound": float(jobs**0.01 - 1),
        "p-inf_vs_min": exact_min,
        "worst_decrease_in_p": worst_drop,
    }


@reproduction(
    "P4-T1",
    claim="Pollux's statistical efficiency E(M) = (phi + M0)/(phi + M) is 1 at M0, falls with M, "
    "tends to 1 as phi -> inf, halves at M = phi + 2 M0, and equals AdaScale's r(M/M0)/(M/M0).",
    target="every identity to 1e-12 (E never increases in M)",
    needs=("elasticlab.goodput", "elasticlab.lr"),
)
def p4_t1(quick: bool) -> Outcome:
    r = efficiency_identities()
    passed = max(r.values()) < 1e-12
    from elasticlab.goodput import efficiency

    m = np.geomspace(32, 32 * 1024, 100)
    fig = lines(
        m,
        {f"phi={phi:g}": efficiency(phi, 32, m) for phi in (10, 100, 1000, 1e4)},
        log_x=True,
        title="P4-T1: statistical efficiency E(M), M0 = 32",
        xaxis="global batch M",
        yaxis="E(M)",
        hlines=((0.5, "1/2 at M = phi + 2 M0"),),
    )
    return Outcome(r, passed, f"largest identity error {max(r.values()):.1e}", fig)


@reproduction(
    "P4-T2",
    claim="Pollux's 7-parameter throughput model, fitted by RMSLE under bounds, predicts step times of "
    "unseen allocations within 10% on average (the paper: <= 10% over 146 allocations).",
    target="synthetic theta_sys, 5% log-normal noise, 30% held out: mean held-out error < 10%; "
    "gamma = 1 is T_grad + T_sync exactly and gamma = 10 is within 7.2% of max(T_grad, T_sync)",
    needs=("elasticlab.goodput",),
)
def p4_t2(quick: bool) -> Outcome:
    r = throughput_fit()
    lo, hi = r["gamma10_over_max"]
    passed = (
        r["heldout_mean_error"] < 0.10 and r["gamma1_sum_error"] < 1e-12 and lo >= 1 - 1e-12 and hi <= 2**0.1
    )
    import plotly.graph_objects as go

    obs, pred = np.array(r.pop("obs")), np.array(r.pop("pred"))
    fig = go.Figure(
        [
            go.Scatter(x=obs, y=pred, mode="markers", name="held-out configurations"),
            go.Scatter(
                x=[obs.min(), obs.max()],
                y=[obs.min(), obs.max()],
                mode="lines",
                name="y = x",
                line=dict(dash="dash"),
            ),
        ]
    )
    fig.update_layout(
        title="P4-T2: fitted vs observed step time (held out)",
        template="plotly_white",
        height=380,
        xaxis_title="observed T_iter (s)",
        yaxis_title="predicted T_iter (s)",
    )
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return Outcome(
        r,
        passed,
        f"held-out mean error {100 * r['heldout_mean_error']:.1f}% "
        f"({100 * r['heldout_mean_error_vs_truth']:.1f}% vs noise-free truth), "
        f"{r['n_train']} fitted / {r['n_test']} held out",
        fig,
    )


@reproduction(
    "P4-T3",
    claim="The Pollux agent's goodput-optimal batch size grows with the gradient noise scale and with the "
    "number of GPUs, and stays at M0 on one GPU when phi -> 0.",
    target="M* non-decreasing in phi and in K on a grid phi in {0, 10, 100, 1e3, 1e4, 1e5} x "
    "K in {1, 2, 4, 8, 16}; "
    "M*(phi ~ 0, K = 1) = M0",
    needs=("elasticlab.goodput",),
    gap="at large phi (1e5) M* on 1 GPU exceeds M* on 2 GPUs: Pollux forces an accumulation step on one GPU "
    "(its GNS needs two micro-batches), and there goodput is nearly flat in M, so the argmax drifts up; "
    "the claim's 'grows with the number of GPUs' holds from 2 GPUs on. We believe the target should "
    "exempt K = 1 under forced accumulation, but it is judged as written",
)
def p4_t3(quick: bool) -> Outcome:
    r = batch_choice()
    passed = r["monotone_in_phi"] and r["monotone_in_gpus"] and r["small_phi_one_gpu"] == r["m0"]
    best = np.array(r["best_batch"])
    fig = lines(
        r["gpus"],
        {f"phi={p:g}": best[i] for i, p in enumerate(r["phis"])},
        log_x=True,
        log_y=True,
        title="P4-T3: goodput-optimal global batch M* (M0 = 32)",
        xaxis="GPUs K",
        yaxis="M*",
    )
    return Outcome(
        r,
        passed,
        f"M* from {best.min():.0f} to {best.max():.0f}; monotone in phi: "
        f"{r['monotone_in_phi']}, in K: {r['monotone_in_gpus']}",
        fig,
    )


@reproduction(
    "P4-T4",
    claim="Pollux's fitness is a power mean of job speedups: p = 1 is the mean, p -> -inf the minimum "
    "(fairest), and it never decreases as p grows.",
    target="200 random 12-job speedup vectors: |F_1/mean - 1| < 1e-12, F_-inf = min, F_-100 within "
    "12^(1/100) - 1 = 2.5% of the min, F_p non-decreasing in p",
    needs=("elasticlab.goodput",),
)
def p4_t4(quick: bool) -> Outcome:
    r = fairness_knob()
    passed = (
        r["p1_vs_mean"] < 1e-12
        and r["p-100_vs_min"] <= r["p-100_bound"] + 1e-9
        and r["p-inf_vs_min"] == 0
        and r["worst_decrease_in_p"] <= 1e-12
    )
    fig = lines(
        [str(p) for p in r["ps"]],
        {"mean over trials of F_p": r["mean_curve"]},
        title="P4-T4: power-mean fitness against p",
        xaxis="p",
        yaxis="F_p",
    )
    return Outcome(
        r,
        passed,
        f"F_1 = mean to {r['p1_vs_mean']:.0e}, F_-100 = min to "
        f"{100 * r['p-100_vs_min']:.2f}%, worst decrease "
        f"{r['worst_decrease_in_p']:.1e}",
        fig,
    )


__all__ = ["TRUE_THETA", "efficiency_identities", "throughput_fit", "batch_choice", "fairness_knob"]


@reproduction(
    "P4-T5",
    claim="Co-adapting GPUs and batch sizes for goodput (Pollux) beats adapting GPUs alone (Optimus) and "
    "fixed tuned allocations (Tiresias) in average JCT on a small cluster (paper: 37-50% lower at 64 GPUs).",
    target="4 nodes x 4 GPUs, 30 synthetic jobs, Poisson arrivals (mean 240 s), each with a known theta_sys, "
    "phi growing 10x over training and work W in M0-equivalent samples (elasticlab.repro.synthetic_cluster; "
    "the parameter ranges are ours, papers.md gives none, set before the first run); (a) Pollux's objective "
    "(DP, p = -1, per-job best batch), (c) Optimus-like (GPUs adapt, batch fixed), (b) Tiresias-like fixed "
    "allocations at tuned configurations (50-80% scalability): JCT(a) < JCT(c) < JCT(b) and (a) at least "
    "20% below (b); full mode: on each of 5 seeds",
    needs=("elasticlab.sim",),
)
def p4_t5(quick: bool) -> Outcome:
    from elasticlab.sim.experiments import ARTIFACT_POLICIES

    from .synthetic_cluster import small_cluster

    seeds = (0,) if quick else (0, 1, 2, 3, 4)
    runs = {s: small_cluster(n_jobs=30, seed=s) for s in seeds}
    jct = {s: {p: v["avg_jct"] for p, v in r["policies"].items()} for s, r in runs.items()}
    cut = {s: 1 - j["pollux"] / j["tiresias"] for s, j in jct.items()}
    ok = {s: j["pollux"] < j["optimus"] < j["tiresias"] and cut[s] >= 0.20 for s, j in jct.items()}
    first = jct[seeds[0]]
    fig = bars(
        ["Pollux objective (a)", "Optimus-like (c)", "Tiresias-like (b)"],
        [first[p] / 3600 for p in ARTIFACT_POLICIES],
        yaxis="average JCT (h)",
        title="P4-T5: average JCT of 30 synthetic jobs on a 4 x 4-GPU cluster (seed 0)",
    )
    measured = {"seeds": list(seeds), "avg_jct_s": jct, "reduction_vs_tiresias": cut,
                "reduction_vs_optimus": {s: 1 - j["pollux"] / j["optimus"] for s, j in jct.items()},
                "passed_per_seed": ok,
                "policies": {s: {p: {k: v for k, v in d.items() if k != "jct"}
                                 for p, d in r["policies"].items()} for s, r in runs.items()},
                "tuned_gpus": runs[seeds[0]]["tuned_gpus"],
                "tuned_batch_x_m0": runs[seeds[0]]["tuned_batch_x_m0"]}
    return Outcome(
        measured,
        all(ok.values()),
        "; ".join(f"seed {s}: Pollux {j['pollux'] / 3600:.2f} h, Optimus {j['optimus'] / 3600:.2f} h, "
                  f"Tiresias {j['tiresias'] / 3600:.2f} h (Pollux {100 * cut[s]:.0f}% below Tiresias)"
                  for s, j in jct.items()),
        fig,
    )
