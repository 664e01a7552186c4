"""P3 (Basu et al. 2019, layer dynamics) and the classical results it builds on (Saxe et al. 2014;
Du et al. 2018; Arora et al. 2018): papers.md P3-T1..T6.
Experiments: :mod:`elasticlab.dynamics.experiments`."""

from __future__ import annotations

from .figures import bars, lines, thin
from .registry import Outcome, reproduction

_NEEDS = ("elasticlab.dynamics.experiments",)


def _exp():
    from elasticlab.dynamics import experiments

    return experiments


@reproduction(
    "P3-T1",
    claim="Gradient descent on a deep linear net keeps W2^T W2 - W1 W1^T fixed, so the layers grow at the "
    "same rate (balancedness; Arora et al. 2018, Du et al. 2018).",
    target="2-layer linear 8->8->8, init 1e-3, lr 1e-3, 20k steps: balancedness drift < 1e-5 and "
    "|d(||W2||^2 - ||W1||^2)| < 1e-5 while ||W_i||^2 grows to ~11.5 (= sum s)",
    needs=_NEEDS,
)
def p3_t1(quick: bool) -> Outcome:
    r = _exp().p3_t1_balancedness(details=True)
    tr = r.pop("runs")["trajectory"]
    grown = abs(min(r["norms_final"]) / r["sum_s"] - 1) < 0.05 and r["growth_factor"] > 1e3
    passed = r["balancedness_drift"] < 1e-5 and r["norm_difference_drift"] < 1e-5 and grown
    steps, norms = thin(tr.steps), thin(tr.weight_norms)
    fig = lines(
        steps,
        {"||W1||^2": norms[:, 0], "||W2||^2": norms[:, 1]},
        log_y=True,
        title="P3-T1: layer norms of a linear net grow together",
        xaxis="GD step",
        yaxis="||W||_F^2",
    )
    return Outcome(
        r,
        passed,
        f"drift {r['balancedness_drift']:.1e}, norms {r['norms_initial'][0]:.1e} -> "
        f"{r['norms_final'][0]:.2f} / {r['norms_final'][1]:.2f}",
        fig,
    )


@reproduction(
    "P3-T2",
    claim="From a balanced aligned start, each SVD mode follows Saxe's sigmoidal closed form "
    "u(t) = s e^{2st}/(e^{2st} - 1 + s/u0); stronger modes are learned first.",
    target="modes s=(4,2,1,0.5,0.25), u0=1e-4: max_t |u_GD - u_Saxe|/s < 1% per mode; half-times within 2% "
    "of (tau/2s) ln((s-u0)/u0); order follows s, also from a random small start",
    needs=_NEEDS,
)
def p3_t2(quick: bool) -> Outcome:
    exp = _exp()
    r = exp.p3_t2_saxe(details=True)
    runs = r.pop("runs")
    passed = (
        max(r["max_rel_error"]) < 0.01
        and max(r["t_half_rel_error"]) < 0.02
        and r["order_follows_s"]
        and r["random_init_order_follows_s"]
    )
    from elasticlab.dynamics import mode_curves, mode_strengths

    tr, task = runs["trajectory"], runs["task"]
    nz = task.s > 0
    u = thin(mode_strengths(tr, task.U, task.V)[:, nz])
    t = thin(tr.time)
    th = mode_curves(t, task.s[nz], runs["u0"], depth=2)
    ys = {}
    for i, s in enumerate(task.s[nz]):
        ys[f"GD s={s:g}"] = u[:, i]
        ys[f"Saxe s={s:g}"] = th[:, i]
    fig = lines(
        t / tr.lr,
        ys,
        dashed=[k for k in ys if k.startswith("Saxe")],
        title="P3-T2: mode strengths, gradient descent vs Saxe's closed form",
        xaxis="GD step",
        yaxis="mode strength u",
    )
    return Outcome(
        r,
        passed,
        f"max error {100 * max(r['max_rel_error']):.2f}% of s, half-times within "
        f"{100 * max(r['t_half_rel_error']):.2f}%",
        fig,
    )


@reproduction(
    "P3-T3",
    claim="Learning has distinct phases: a plateau, then one burst of layer growth per distinct singular "
    "value (a staircase), then saturation (our operationalisation of P3's phases).",
    target="P3-T1 run: detected growth bursts = number of distinct nonzero s (5); growth < 1% of the total "
    "over the first 40% of the plateau time tau/(2 s_max) ln(s_max/u0), u0 = |u_1(0)| the top mode's "
    "starting strength",
    needs=_NEEDS,
)
def p3_t3(quick: bool) -> Outcome:
    r = _exp().p3_t3_phases(details=True)
    runs = r.pop("runs")
    passed = r["n_bursts"] == r["n_distinct_modes"] and r["plateau_growth_fraction"] < 0.01
    tr = runs["trajectory"]
    fig = lines(
        thin(tr.steps),
        {"||W1||^2": thin(tr.weight_norms[:, 0])},
        vlines=r["burst_times"],
        title="P3-T3: plateau, one growth burst per mode (dotted), saturation",
        xaxis="GD step",
        yaxis="||W1||_F^2",
    )
    return Outcome(
        r,
        passed,
        f"{r['n_bursts']} bursts for {r['n_distinct_modes']} modes, plateau growth "
        f"{100 * r['plateau_growth_fraction']:.3f}% (plateau time {r['plateau_time_theory']:.0f} steps, "
        f"first burst at {r['burst_times'][0]:.0f})",
        fig,
    )


@reproduction(
    "P3-T4",
    claim="In a bias-free ReLU net every layer's ||W_h||_F^2 grows by the same amount (Du et al. 2018).",
    target="ReLU MLP 10->32->32->3, no biases, 3000 GD steps: growth of ||W_h||^2 equal across layers "
    "within 1% (calibrated 4.526 / 4.527 / 4.527 at lr 1e-2)",
    needs=_NEEDS,
)
def p3_t4(quick: bool) -> Outcome:
    r = _exp().p3_t4_relu_no_bias(lrs=(1e-2,) if quick else (2e-2, 1e-2, 5e-3))
    passed = r["relative_spread"] < 0.01
    fig = bars(
        [f"layer {i + 1}" for i in range(len(r["growth"]))],
        r["growth"],
        yaxis="growth of ||W_h||^2",
        title="P3-T4: bias-free ReLU net, equal layer growth",
    )
    return Outcome(
        r,
        passed,
        f"growth {' / '.join(f'{g:.3f}' for g in r['growth'])}, spread {100 * r['relative_spread']:.2f}%",
        fig,
    )


@reproduction(
    "P3-T5",
    claim="With biases the ReLU net's weight-only growth differs across layers (the symmetry breaks), while "
    "the corrected invariant ||W_h||^2 + ||b_h||^2 - ||W_{h+1}||^2 is conserved.",
    target="same net with biases: spread of the weight growth > 10% and corrected-invariant drift < 1e-3 "
    "(calibrated 3.55 / 4.07 / 4.13, drift 2-5e-4)",
    needs=_NEEDS,
)
def p3_t5(quick: bool) -> Outcome:
    r = _exp().p3_t5_relu_bias()
    passed = r["relative_spread"] > 0.10 and r["layer_invariant_drift"] < 1e-3
    fig = bars(
        [f"layer {i + 1}" for i in range(len(r["growth"]))],
        r["growth"],
        yaxis="growth of ||W_h||^2",
        title="P3-T5: ReLU net with biases, unequal weight growth",
    )
    return Outcome(
        r,
        passed,
        f"growth {' / '.join(f'{g:.2f}' for g in r['growth'])} (spread "
        f"{100 * r['relative_spread']:.0f}%), invariant drift "
        f"{r['layer_invariant_drift']:.1e}",
        fig,
    )


@reproduction(
    "P3-T6",
    claim="A ReLU net equals its linearisation W_eff(x) = W3 D2(x) W2 D1(x) W1 through its activation masks "
    "(exploratory: masked layer growth compared with the linear net; no paper numbers).",
    target="linearised output equals the ReLU net's to < 1e-10 at every recorded step, with and without "
    "biases",
    needs=_NEEDS,
)
def p3_t6(quick: bool) -> Outcome:
    r = _exp().p3_t6_linearisation()
    err = max(r["no_bias"]["exactness_error"], r["bias"]["exactness_error"])
    passed = err < 1e-10
    import plotly.graph_objects as go

    fig = go.Figure()
    layers = [f"layer {i + 1}" for i in range(len(r["linear_growth"]))]
    for name, vals in (
        ("linear net: ||W||^2", r["linear_growth"]),
        ("ReLU no bias: ||W||^2", r["no_bias"]["weight_growth"]),
        ("ReLU no bias: E||D W||^2", r["no_bias"]["masked_growth"]),
        ("ReLU bias: E||D W||^2", r["bias"]["masked_growth"]),
    ):
        fig.add_trace(go.Bar(x=layers, y=vals, name=name))
    fig.update_layout(
        title="P3-T6: per-layer growth, linear vs mask-linearised ReLU",
        template="plotly_white",
        height=380,
        barmode="group",
        yaxis_title="growth",
    )
    return Outcome(
        r,
        passed,
        f"exactness error {err:.1e}; masked growth spread "
        f"{r['masked_relative_spread']:.2f} (built in by the masks: hidden units active "
        f"{' / '.join(f'{p:.2f}' for p in r['no_bias']['active_fraction_final'])} of the time) "
        f"vs linear {r['linear_relative_spread']:.4f}",
        fig,
    )


__all__ = ["p3_t1", "p3_t2", "p3_t3", "p3_t4", "p3_t5", "p3_t6"]
