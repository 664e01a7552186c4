"""Reproductions on the noisy quadratic model, as functions returning numbers (reused by
``elasticlab reproduce``): P2-T1/T2 (Dynamic SGD vs the momentum-noise spike, Lin et al. 2019) and
P6-T2/T3 (AdaScale's scale invariance, Johnson et al. 2020); P2-T3 (Dynamic SGD on scikit-learn digits with
workers emulated by gradient accumulation) and P6-T4 (Thm. 2's convergence bounds on a PL quadratic).
See ``shared/reference/papers.md``."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from .adascale import AdaScale, AdaScaleEstimator, adascale_moments_from_norms
from .dynamic_sgd import DynamicSGD
from .nqm import NoisyQuadratic
from .wrapper import ElasticLR

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


# ---------------------------------------------------------------------------------------------- P2-T3
DIGITS_VARIANTS = ("fixed", "dynamic_sgd", "immediate", "none")


@contextlib.contextmanager
def _torch_threads(n):
    """Run the block with ``n`` torch threads (``None``: unchanged), then restore the previous count."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def digits_splits(seeds=8, test_fraction=0.3, seed=0):
    """scikit-learn's digits (pixels / 16), one stratified train/test split per seed, stacked:
    ``(x_train (seeds, n, 64), y_train (seeds, n), x_test, y_test)`` as torch tensors."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    parts = [train_test_split(x / 16.0, y, test_size=test_fraction, stratify=y, random_state=seed + s)
             for s in range(int(seeds))]
    xtr, xte, ytr, yte = (np.stack([p[i] for p in parts]) for i in range(4))
    f32, i64 = torch.float32, torch.long
    return (torch.tensor(xtr, dtype=f32), torch.tensor(ytr, dtype=i64),
            torch.tensor(xte, dtype=f32), torch.tensor(yte, dtype=i64))


def batched_mlp(seeds, hidden=64, inputs=64, classes=10, seed=0):
    """One copy per seed of ``examples/digits.py``'s MLP (Linear-ReLU-Linear, weights ~ N(0, 1/fan_in),
    biases ~ N(0, 1/width)) as stacked leaf tensors ``[W1 (s, in, h), b1 (s, 1, h), W2, b2]``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [((inputs, hidden), inputs), ((1, hidden), hidden), ((hidden, classes), hidden),
              ((1, classes), classes)]
    return [(torch.randn(int(seeds), *shape, generator=gen) * fan ** -0.5).requires_grad_()
            for shape, fan in shapes]


def batched_mlp_forward(params, x):
    """Logits of every seed's MLP on its own inputs: ``x (seeds, m, in) -> (seeds, m, classes)``."""
    w1, b1, w2, b2 = params
    return torch.baddbmm(b2, torch.baddbmm(b1, x, w1).relu(), w2)


def accumulate_worker_grads(params, x, y, workers):
    """Emulate ``workers`` data-parallel workers by gradient accumulation: the global batch ``x (seeds,
    workers * b, in)`` is cut into ``workers`` micro-batches of b, and each micro-batch's mean-loss gradient
    is added with weight 1/workers (what an all-reduce average gives). Per seed this equals the gradient of
    the mean loss over the whole global batch. Grads land in ``p.grad`` (zeroed first); returns the mean
    loss per seed."""
    workers = int(workers)
    if workers < 1 or x.shape[1] % workers:
        raise ValueError(f"global batch {x.shape[1]} does not split into {workers} equal micro-batches")
    for p in params:
        p.grad = None
    total = torch.zeros(x.shape[0])
    for xs, ys in zip(x.chunk(workers, dim=1), y.chunk(workers, dim=1)):
        logits = batched_mlp_forward(params, xs)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ys, reduction="none").mean(1)
        (loss.sum() / workers).backward()  # seeds are independent: summing their losses keeps grads apart
        total += loss.detach() / workers
    return total


def digits_elastic_run(variant, schedule=(1, 8, 2, 8), epochs=40, seeds=8, base_batch=32, lr=0.05,
                       momentum=0.9, hidden=64, ramp_steps_per_k=8.0, seed=0, data=None, evals=40,
                       threads=1):
    """P2-T3, one arm: the digits MLP (``examples/digits.py``) trained for ``epochs`` passes over the
    training split, ``seeds`` independent copies at once (each with its own split, init and example order).

    ``schedule``: workers per phase; every phase has the same number of optimizer steps (the same wall time
    at a fixed per-worker batch ``base_batch``), sized so the run consumes ``epochs`` epochs; k workers =
    k accumulated micro-batches, global batch k * b0. ``variant``: ``"dynamic_sgd"`` (linear scaling with
    Lin et al.'s ramp over T = 8k steps, momentum kept), ``"immediate"`` (linear scaling at once),
    ``"none"`` (LR unchanged), ``"fixed"`` (one worker at b0 throughout, the same examples in the same
    order). Returns the final test accuracy per seed, the accuracy curve against examples seen, the
    phase boundaries (in examples), the steps, and for every batch change by k the drop of the seed-mean
    accuracy within the next 8k steps (``{"1->8": ...}``; P2-T1's momentum-noise spike on a real task).
    ``threads``: torch threads while training (tiny matmuls: one avoids oversubscribing a shared machine)."""
    if variant not in DIGITS_VARIANTS:
        raise ValueError(f"variant must be one of {DIGITS_VARIANTS}, got {variant!r}")
    schedule = [int(k) for k in schedule]
    if not schedule or min(schedule) < 1:
        raise ValueError(f"schedule must list worker counts >= 1, got {schedule}")
    xtr, ytr, xte, yte = data if data is not None else digits_splits(seeds, seed=seed)
    seeds, n = ytr.shape
    total = int(epochs * n)
    steps = max(1, total // (base_batch * sum(schedule)))  # per phase
    phases = [(steps, k) for k in schedule] if variant != "fixed" else [(steps * sum(schedule), 1)]
    examples = steps * base_batch * sum(schedule)
    gen = torch.Generator().manual_seed(seed + 1)  # the same example stream for every variant
    order = torch.cat([torch.argsort(torch.rand(seeds, n, generator=gen), dim=1)
                       for _ in range(-(-examples // n))], dim=1)
    rows = torch.arange(seeds)[:, None]
    params = batched_mlp(seeds, hidden=hidden, seed=seed + 2)
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    rule = "identity" if variant == "none" else "linear"
    ramp = DynamicSGD(steps_per_k=ramp_steps_per_k) if variant == "dynamic_sgd" else None
    elr = ElasticLR(opt, base_batch, rule=rule, ramp=ramp, global_batch=phases[0][1] * base_batch)

    def accuracy():
        with torch.no_grad():
            return (batched_mlp_forward(params, xte).argmax(-1) == yte).double().mean(1).numpy()

    eval_every = max(1, examples // max(int(evals), 1))
    seen, next_eval, curve, bounds = 0, eval_every, [(0, accuracy())], []
    with _torch_threads(threads):
        for n_steps, k in phases:
            elr.on_batch_change(k * base_batch)
            bounds.append(seen)
            for _ in range(n_steps):
                idx = order[:, seen:seen + k * base_batch]
                accumulate_worker_grads(params, xtr[rows, idx], ytr[rows, idx], k)
                elr.step()
                seen += k * base_batch
                if seen >= next_eval:
                    curve.append((seen, accuracy()))
                    next_eval += eval_every
    final = accuracy()
    xs, ys = np.array([c[0] for c in curve]), np.array([c[1].mean() for c in curve])
    drops = {}  # each batch change: seed-mean accuracy before it - its lowest value in the next 8k steps
    if variant != "fixed":
        ramp_len = DynamicSGD(steps_per_k=ramp_steps_per_k).ramp_length
        for i in range(1, len(schedule)):
            old, new = schedule[i - 1], schedule[i]
            start = bounds[i]
            after = (xs > start) & (xs <= start + ramp_len(new / old) * new * base_batch)
            if new != old and after.any():
                drops[f"{old}->{new}"] = float(ys[xs <= start][-1] - ys[after].min())
    return {"variant": variant, "accuracy": final, "mean_accuracy": float(final.mean()),
            "examples": seen, "steps": elr.steps, "phase_starts": bounds[1:] if variant != "fixed" else [],
            "switch_drops": drops, "curve_examples": xs, "curve_accuracy": ys}


def elastic_digits(variants=("fixed", "dynamic_sgd", "immediate"), seeds=8, **kw):
    """P2-T3: every arm of :func:`digits_elastic_run` on the same seeds (splits, inits, example order).
    Returns per arm the mean final test accuracy (in %), its per-seed values, the accuracy drops after
    each batch change (in points), the paired differences
    ``dynamic_sgd - fixed`` and ``dynamic_sgd - immediate`` (mean and standard error, in points) and the
    mean accuracy curves."""
    data = digits_splits(seeds, seed=kw.get("seed", 0))
    runs = {v: digits_elastic_run(v, seeds=seeds, data=data, **kw) for v in variants}
    acc = {v: 100.0 * r["accuracy"] for v, r in runs.items()}
    out = {"accuracy": {v: float(a.mean()) for v, a in acc.items()},
           "per_seed": {v: a for v, a in acc.items()}, "seeds": int(seeds),
           "steps": {v: r["steps"] for v, r in runs.items()},
           "examples": {v: r["examples"] for v, r in runs.items()},
           "phase_starts": runs[variants[-1]]["phase_starts"],
           "switch_drops": {v: {s: 100.0 * d for s, d in r["switch_drops"].items()}
                            for v, r in runs.items() if v != "fixed"},
           "curves": {v: {"examples": r["curve_examples"], "accuracy": 100.0 * r["curve_accuracy"]}
                      for v, r in runs.items()}}
    diffs = {}
    for a, b in (("dynamic_sgd", "fixed"), ("dynamic_sgd", "immediate")):
        if a in acc and b in acc:
            d = acc[a] - acc[b]
            se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan
            diffs[f"{a}-{b}"] = {"mean": float(d.mean()), "se": se}
    out["difference"] = diffs
    return out


# ---------------------------------------------------------------------------------------------- P6-T4
def sgd_pl_bound(f0_gap, lr, alpha, beta, v, steps, scale=1, rule="adascale"):
    """AdaScale's convergence bounds for SGD with constant lr on an alpha-PL, beta-smooth F whose
    base-batch gradient variance is <= V (Johnson et al. 2020, Thm. 2; papers.md P6): with
    gamma = lr * alpha * (2 - lr * beta) and Delta = lr^2 beta V / (2 gamma),

    - ``rule="adascale"``: ``(F0 - F*) exp(-gamma T_SI) + Delta`` (``steps`` = T_SI, any S);
    - ``rule="linear"`` (lr * S at batch S * b, needs S lr beta < 2): ``(F0 - F*) exp(-gamma c^-1 S T)
      + c Delta`` with ``c = (2 - lr beta) / (2 - S lr beta)`` (``steps`` = T iterations).

    Returns ``(bound, floor)``; vectorised over ``steps``."""
    if not 0 < lr * beta < 2:
        raise ValueError(f"need 0 < lr * beta < 2, got lr={lr}, beta={beta}")
    if not (0 < alpha <= beta and v >= 0):
        raise ValueError(f"need 0 < alpha <= beta and V >= 0, got alpha={alpha}, beta={beta}, V={v}")
    gamma = lr * alpha * (2.0 - lr * beta)
    delta = lr * lr * beta * v / (2.0 * gamma)
    steps = np.asarray(steps, dtype=float)
    if rule == "adascale":
        return f0_gap * np.exp(-gamma * steps) + delta, delta
    if rule != "linear":
        raise ValueError(f"rule must be 'adascale' or 'linear', got {rule!r}")
    if not scale * lr * beta < 2:
        raise ValueError(f"linear scaling needs S * lr * beta < 2, got {scale * lr * beta}")
    c = (2.0 - lr * beta) / (2.0 - scale * lr * beta)
    return f0_gap * np.exp(-gamma / c * scale * steps) + c * delta, c * delta


def pl_quadratic_run(scale, rule="adascale", t_si=1000, dim=100, replicas=1000, lr=0.025, alpha=0.1,
                     beta=1.0, base_batch=1, checkpoints=20, seed=0):
    """Plain SGD (no momentum, constant lr: Thm. 2's setting) on the PL quadratic
    ``F = 1/2 sum_i h_i w_i^2``, h log-spaced in [alpha, beta] (so F is alpha-PL and beta-smooth, F* = 0)
    with base-batch gradient noise of trace V = sum(h) / b (the NQM). ``replicas`` independent runs at once
    from w0 = 1/sqrt(h). ``rule="adascale"``: every replica takes lr * r_t with its own exact gain
    ``r_t = gain_ratio(V, |grad F(w_t)|^2, S)`` and stops once tau = sum r_t >= T_SI; ``"linear"``: lr * S
    for ceil(T_SI / S) iterations. Returns, at tau = T_SI * j / checkpoints, the mean (and standard error)
    of F - F* over replicas (each taken at its first iteration with tau >= that value) and the bound of
    :func:`sgd_pl_bound` there, plus alpha, beta, V and the mean iterations."""
    from .adascale import gain_ratio
    from .base import get_rule

    scale = int(scale)
    if scale < 1:
        raise ValueError(f"scale must be an integer >= 1, got {scale}")
    if rule not in ("adascale", "linear"):
        raise ValueError(f"rule must be 'adascale' or 'linear', got {rule!r}")
    rng = np.random.default_rng(seed)
    h = NoisyQuadratic(dim, h_min=alpha, h_max=beta).h.numpy()
    v = float(h.sum()) / base_batch  # sigma^2 of one base-batch gradient: the same everywhere, so V
    noise = np.sqrt(h / (scale * base_batch))  # the mean of S worker gradients of batch b each
    w = np.ones((replicas, dim)) / np.sqrt(h)
    f0 = 0.5 * float(dim)
    grid = t_si * np.arange(1, checkpoints + 1) / checkpoints
    rec = np.full((replicas, checkpoints), np.nan)
    tau, iters = np.zeros(replicas), np.zeros(replicas)
    linear = get_rule("linear").multiplier(scale)
    active = np.ones(replicas, dtype=bool)
    while active.any():
        hw = h * w
        if rule == "adascale":
            r = np.asarray(gain_ratio(v, np.einsum("ij,ij->i", hw, hw), scale), dtype=float)
        else:
            r = np.full(replicas, linear)
        r = np.where(active, r, 0.0)
        w -= (lr * r)[:, None] * (hw + noise * rng.standard_normal(w.shape))
        tau += r
        iters += active
        f = 0.5 * np.einsum("ij,j,ij->i", w, h, w)
        hit = (tau[:, None] >= grid[None, :] - 1e-9) & np.isnan(rec)
        rec[hit] = np.broadcast_to(f[:, None], rec.shape)[hit]
        active = tau < t_si - 1e-9
    emp = rec.mean(0)
    se = rec.std(0, ddof=1) / math.sqrt(replicas) if replicas > 1 else np.full(checkpoints, np.nan)
    if rule == "adascale":
        bound, floor = sgd_pl_bound(f0, lr, alpha, beta, v, grid)
    else:
        bound, floor = sgd_pl_bound(f0, lr, alpha, beta, v, np.ceil(grid / scale - 1e-9), scale, "linear")
    return {"scale": scale, "rule": rule, "taus": grid, "empirical": emp, "stderr": se, "bound": bound,
            "floor": floor, "final": float(emp[-1]), "final_stderr": float(se[-1]),
            "final_bound": float(bound[-1]), "iterations": float(iters.mean()), "f0": f0, "alpha": alpha,
            "beta": beta, "V": v, "lr": lr}


def linear_scaling_floor(scale, dim=100, replicas=200, lr=0.025, alpha=0.1, beta=1.0, base_batch=1,
                         relaxations=5.0, seed=0):
    """The stationary E[F - F*] of SGD with linear scaling (lr * S, batch S * b) on the PL quadratic of
    :func:`pl_quadratic_run`: from w = w* for ``relaxations`` times the slowest mode's variance relaxation
    time (E w_i^2 contracts by (1 - S lr h_i)^2 a step), then averaged over as many more (at least 200).
    Also returns the exact stationary value ``sum_i lr h_i / (2 b (2 - S lr h_i))`` (Gaussian noise) and
    the bound's floor c * Delta."""
    scale = int(scale)
    if not scale * lr * beta < 2:
        raise ValueError(f"linear scaling needs S * lr * beta < 2, got {scale * lr * beta}")
    rng = np.random.default_rng(seed)
    h = NoisyQuadratic(dim, h_min=alpha, h_max=beta).h.numpy()
    step, noise = lr * scale, np.sqrt(h / (scale * base_batch))
    x = step * np.array([alpha, beta])
    burn = int(math.ceil(relaxations / np.min(x * (2.0 - x))))  # E w^2 contracts by (1 - x)^2 a step
    window = max(burn, 200)
    w, total = np.zeros((replicas, dim)), 0.0
    for t in range(burn + window):
        w -= step * (h * w + noise * rng.standard_normal(w.shape))
        if t >= burn:
            total += 0.5 * float(np.einsum("ij,j,ij->", w, h, w)) / replicas
    exact = float(np.sum(lr * h / (2.0 * base_batch * (2.0 - scale * lr * h))))
    _, floor = sgd_pl_bound(1.0, lr, alpha, beta, float(h.sum()) / base_batch, 0.0, scale, "linear")
    return {"scale": scale, "empirical": total / window, "exact": exact, "bound_floor": float(floor),
            "factor": (2.0 - lr * beta) / (2.0 - scale * lr * beta), "iterations": burn + window}


def adascale_bound_check(scales=(1, 4, 16, 64), replicas=1000, floor_replicas=200, **kw):
    """P6-T4: for every S, AdaScale's empirical E[F - F*] at tau = T_SI (and along the way) against its
    Thm. 2 bound, linear scaling's against its bound, and the linear-scaling floor at every S (on the
    PL quadratic and on an isotropic one, h = beta, where the floor ratio must equal
    (2 - lr beta) / (2 - S lr beta) exactly). Keyword arguments go to :func:`pl_quadratic_run`."""
    common = {k: kw[k] for k in ("dim", "lr", "alpha", "beta", "base_batch") if k in kw}
    ada = {s: pl_quadratic_run(s, "adascale", replicas=replicas, seed=s, **kw) for s in scales}
    lin = {s: pl_quadratic_run(s, "linear", replicas=replicas, seed=100 + s, **kw) for s in scales}
    floors = {s: linear_scaling_floor(s, replicas=floor_replicas, seed=200 + s, **common) for s in scales}
    iso_kw = dict(common, alpha=common.get("beta", 1.0))
    iso = {s: linear_scaling_floor(s, replicas=floor_replicas, seed=300 + s, **iso_kw) for s in scales}
    s0 = scales[0]
    return {
        "alpha": ada[s0]["alpha"], "beta": ada[s0]["beta"], "V": ada[s0]["V"], "lr": ada[s0]["lr"],
        "f0": ada[s0]["f0"], "t_si": float(ada[s0]["taus"][-1]),
        "adascale": {s: {"empirical": r["final"], "stderr": r["final_stderr"], "bound": r["final_bound"],
                         "iterations": r["iterations"],
                         "max_ratio_to_bound": float(np.max(r["empirical"] / r["bound"]))}
                     for s, r in ada.items()},
        "linear": {s: {"empirical": r["final"], "stderr": r["final_stderr"], "bound": r["final_bound"],
                       "iterations": r["iterations"],
                       "max_ratio_to_bound": float(np.max(r["empirical"] / r["bound"]))}
                   for s, r in lin.items()},
        "floor": {s: {"empirical": f["empirical"], "exact": f["exact"], "bound_floor": f["bound_floor"],
                      "factor": f["factor"], "ratio": f["empirical"] / floors[s0]["empirical"]}
                  for s, f in floors.items()},
        "isotropic_floor": {s: {"empirical": f["empirical"], "exact": f["exact"], "factor": f["factor"],
                                "ratio": f["empirical"] / iso[s0]["empirical"]} for s, f in iso.items()},
        "curves": {s: {k: r[k] for k in ("taus", "empirical", "stderr", "bound")} for s, r in ada.items()},
        "linear_curves": {s: {k: r[k] for k in ("taus", "empirical", "stderr", "bound")}
                          for s, r in lin.items()},
    }
