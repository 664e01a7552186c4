"""P2-T3: Dynamic SGD on scikit-learn's digits, workers emulated by gradient accumulation (Lin et al.)."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from ..dynamic_sgd import DynamicSGD
from ..wrapper import ElasticLR

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
