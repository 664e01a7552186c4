"""P2 (Lin et al. 2019, Dynamic SGD) on the noisy quadratic model: the momentum-noise spike after a k-fold
batch jump with immediate linear LR scaling, and its removal by a linear LR ramp (papers.md P2-T1, P2-T2);
and on a real task, scikit-learn digits with workers 1 -> 8 -> 2 -> 8 (P2-T3).
Experiments: :mod:`elasticlab.lr.experiments`."""

from __future__ import annotations

import numpy as np

from .figures import lines
from .registry import Outcome, reproduction

_NEEDS = ("elasticlab.lr.experiments",)


def _spike_runs(noise: bool, quick: bool, variants):
    from elasticlab.lr.experiments import batch_jump_run

    seeds = 6 if quick else 20
    runs = {}
    for name, variant, ramp in variants:
        runs[name] = batch_jump_run(variant, ramp_steps=ramp, k=8, seeds=seeds, noise=noise)
    return runs, seeds


def _figure(runs, title, window=50, before=150):
    t0 = 2000
    ys = {}
    for name, r in runs.items():
        loss = np.asarray(r["losses"])
        x = np.arange(t0 - before, len(loss)) - t0
        ys[name] = (x, loss[t0 - before :] / r["loss_before"])
    return lines(
        None,
        ys,
        title=title,
        xaxis="steps after the 8x batch jump",
        yaxis="loss / mean loss before the jump",
        vlines=(0,),
        hlines=((1.0, "before"),),
    )


@reproduction(
    "P2-T1",
    claim="Scaling the LR by k at once when the batch grows k-fold makes the loss spike (momentum holds "
    "small-batch noise); ramping the LR linearly over T = 8k steps removes the spike.",
    target="NQM d=1000, k=8: peak loss in 50 steps after the jump / loss before: immediate > 2x, "
    "ramp T=8k < 1.2x (calibrated: 4.9x, ramp T=8: 1.8x, T=64: 0.99x)",
    needs=_NEEDS,
)
def p2_t1(quick: bool) -> Outcome:
    variants = [("immediate x8", "immediate", None), ("ramp T=8", "ramp", 8), ("ramp T=8k=64", "ramp", None)]
    if not quick:
        variants.append(("no LR change", "none", None))
    runs, seeds = _spike_runs(True, quick, variants)
    peak = {k: r["peak_ratio"] for k, r in runs.items()}
    end = {k: r["end_ratio"] for k, r in runs.items()}
    passed = peak["immediate x8"] > 2.0 and peak["ramp T=8k=64"] < 1.2
    return Outcome(
        measured={"peak_ratio": peak, "end_ratio": end, "seeds": seeds},
        passed=passed,
        summary=f"immediate {peak['immediate x8']:.2f}x, ramp T=8 {peak['ramp T=8']:.2f}x, "
        f"ramp T=64 {peak['ramp T=8k=64']:.2f}x",
        figure=_figure(runs, "P2-T1: loss spike after an 8x batch jump (NQM, momentum 0.9)"),
    )


@reproduction(
    "P2-T2",
    claim="The spike is driven by gradient noise: without noise, neither immediate scaling nor the ramp "
    "spikes.",
    target="noise-free NQM: peak ratio < 1.05 for immediate x8 and for the ramp (calibrated 0.99 / 1.00)",
    needs=_NEEDS,
)
def p2_t2(quick: bool) -> Outcome:
    runs, seeds = _spike_runs(
        False, quick, [("immediate x8", "immediate", None), ("ramp T=8k=64", "ramp", None)]
    )
    peak = {k: r["peak_ratio"] for k, r in runs.items()}
    passed = all(v < 1.05 for v in peak.values())
    return Outcome(
        measured={"peak_ratio": peak, "seeds": seeds},
        passed=passed,
        summary=f"immediate {peak['immediate x8']:.3f}x, ramp {peak['ramp T=8k=64']:.3f}x",
        figure=_figure(runs, "P2-T2: the same jump without gradient noise"),
    )


@reproduction(
    "P2-T3",
    claim="On a real task with workers coming and going (1 -> 8 -> 2 -> 8), Dynamic SGD (linear scaling "
    "reached by a ramp over T = 8k steps) ends as accurate as a fixed-batch run on the same examples, and "
    "no worse than immediate linear scaling.",
    target="scikit-learn digits MLP (examples/digits.py: b0 = 32, lr 0.05, momentum 0.9), 40 epochs, "
    "k workers = k accumulated micro-batches, equal steps per phase; seed-mean final test accuracy: Dynamic "
    "SGD within 0.5 pt of the fixed-batch (b0) run, and no worse than immediate linear scaling (seed-mean "
    "paired difference >= 0, as papers.md writes it; whether a shortfall is within 2 standard errors is "
    "reported apart, never as a pass). Qualitative: the paper has no numbers",
    needs=_NEEDS,
    reread="the task (scikit-learn digits, not an MNIST/CIFAR-10 subset) and the seed counts were set after "
    "the first runs; a quick pass (8 seeds) of 'no worse than immediate linear scaling' is within noise "
    "(+0.02 +- 0.10 pt), and the full 64-seed run measured -0.07 +- 0.05 pt, which does not pass",
    gap="over 64 seeds Dynamic SGD ends a few hundredths of a point below immediate linear scaling, a "
    "shortfall within 2 standard errors: on digits (near 97% accuracy, an easier task than the paper's) "
    "immediate scaling loses nothing that the ramp could save; why the ramp then costs a little is not "
    "established. We do not doubt the target, only whether this task can show it",
)
def p2_t3(quick: bool) -> Outcome:
    from elasticlab.lr.experiments import elastic_digits

    variants = ("fixed", "dynamic_sgd", "immediate") + (() if quick else ("none",))
    res = elastic_digits(variants=variants, seeds=8 if quick else 64)
    acc, diff = res["accuracy"], res["difference"]
    vs_fixed, vs_imm = diff["dynamic_sgd-fixed"], diff["dynamic_sgd-immediate"]
    passed = abs(vs_fixed["mean"]) <= 0.5 and vs_imm["mean"] >= 0.0
    # Reported, not judged: a shortfall against immediate scaling within 2 SE is a statistical tie.
    res["dynamic_vs_immediate_within_2se"] = bool(vs_imm["mean"] >= -2.0 * vs_imm["se"])
    curves = res.pop("curves")
    names = {"fixed": "fixed batch b0", "dynamic_sgd": "Dynamic SGD (ramp 8k)",
             "immediate": "immediate linear scaling", "none": "no LR change"}
    fig = lines(
        None,
        {names[v]: (c["examples"], c["accuracy"]) for v, c in curves.items()},
        title=f"P2-T3: digits, workers 1 -> 8 -> 2 -> 8 (mean of {res['seeds']} seeds)",
        xaxis="training examples seen",
        yaxis="test accuracy (%)",
        vlines=res["phase_starts"],
    )
    fig.update_yaxes(range=[85, 100])
    drops = res["switch_drops"]
    return Outcome(
        res,
        passed,
        f"test acc. fixed {acc['fixed']:.2f}%, Dynamic SGD {acc['dynamic_sgd']:.2f}%, immediate "
        f"{acc['immediate']:.2f}% ({res['seeds']} seeds); Dynamic - fixed {vs_fixed['mean']:+.2f} "
        f"+- {vs_fixed['se']:.2f} pt, Dynamic - immediate {vs_imm['mean']:+.2f} +- {vs_imm['se']:.2f} pt"
        + (" (a shortfall within 2 SE: a statistical tie, not a pass)" if vs_imm["mean"] < 0
           and res["dynamic_vs_immediate_within_2se"] else "") + "; "
        "accuracy drop after each switch (Dynamic / immediate): "
        + ", ".join(f"{s} {max(0.0, d):.1f} / {max(0.0, drops['immediate'][s]):.1f} pt"
                    for s, d in drops["dynamic_sgd"].items()),
        fig,
    )
