"""The forms of McCandlish et al.'s App. A.1 estimator that :class:`~elasticlab.gns.monitor.GNSMonitor`
measures a step by, each folding what the step left into a :class:`~elasticlab.gns.estimator.GNSEstimator`.

- ``"per_example"``: per-example ‖g_i‖² against ‖ḡ‖² (:func:`per_example`): one backward's, on a process
  group every process's; under FSDP2, those of every micro-batch of the step.
- ``"micro_batch"``: several backwards (gradient accumulation): each micro-batch's ‖ḡ_k‖² against the
  accumulated ‖ḡ‖² (:func:`micro_batch`).
- ``"replica"``: each DDP replica's local ‖ḡ_r‖² against the averaged one
  (:meth:`~elasticlab.gns.ddp.ReplicaGradNorms.fold`).

Unequal batches b_k enter through their harmonic mean H: E mean_k‖ḡ_k‖² = ‖G‖² + tr Σ/H and, gradients
averaged with equal weights, E‖ḡ‖² = ‖G‖² + tr Σ/(K·H) (Eq. A.1). Each returns (folded, examples).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from elasticlab.checks import whole
from elasticlab.gns.estimator import GNSEstimator, check_beta

#: The forms, and ``"auto"``: the monitor's choice (module docstring of :mod:`~elasticlab.gns.monitor`).
METHODS = ("auto", "per_example", "micro_batch", "replica")


def check_settings(every, beta, method) -> int:
    """``every`` (returned as an int), ``beta`` and ``method``, one rule each: checked by the monitor, and by
    the Lightning and HF Trainer callbacks when they are made (their monitor is made at the start of the
    fit, too late for a clear error)."""
    every = whole("every", every, 1, "an integer >= 1")
    check_beta(beta)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return every


def layer_of(named) -> list[str]:
    """Each parameter's module name, from ``(name, parameter)`` pairs: the key of its per-layer estimate."""
    return [n.rpartition(".")[0] for n, _ in named]


def layer_groups(layers: list[str]) -> dict[str, list[int]]:
    """{module: the indices of its parameters} from :func:`layer_of`'s list."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(layers):
        groups.setdefault(name, []).append(i)
    return groups


def comm_device(group) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the current GPU under NCCL, else the CPU."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def per_example(estimator: GNSEstimator, rows: list[torch.Tensor], grad_sq: float, means: bool = True,
                layers: dict | None = None, world: int = 1, group=None) -> tuple[bool, int]:
    """``rows``: each micro-batch's (b,) per-example ‖g_i‖² (``PerSampleGradNorms.sq_norms()``) of one step
    on this process, against ``grad_sq``, ‖ḡ‖² of the step's gradient (identical on every process);
    ``layers``: {module: (its rows, its ‖ḡ‖²)}, folded per layer too. B_small = 1; B_big: with ``means`` (each
    micro-batch's loss a mean, the micro-batches' and processes' gradients averaged) m·H for m micro-batches
    of harmonic mean size H (Eq. A.1), else the number of examples. On ``world`` > 1 processes one
    all-reduce of [Σ ‖g_i‖², examples, Σ 1/b, micro-batches, Σ per layer]."""
    rows = [rows] if isinstance(rows, torch.Tensor) else list(rows)      # (one micro-batch's)
    names = list(layers or {})
    if world <= 1 and len(rows) == 1:    # one batch: B_big = b either way (non-finite rows skipped, counted)
        one = {k: (layers[k][0][0], layers[k][1]) for k in names}
        return estimator.update(rows[0], grad_sq, layers=one), int(rows[0].shape[0])
    sums = torch.stack([torch.cat(rows).double().sum()]
                       + [torch.cat(layers[k][0]).double().sum() for k in names]).cpu()
    counts = [float(sum(r.numel() for r in rows)), sum(1.0 / r.numel() for r in rows), float(len(rows))]
    t = torch.cat([sums[:1], torch.tensor(counts, dtype=torch.float64), sums[1:]])
    if world > 1:
        t = t.to(comm_device(group))
        dist.all_reduce(t, group=group)
    total, n, inv, m, *per_layer = t.tolist()
    b_big = m * m / inv if means else n
    folded = estimator.update_two_batch(total / n, grad_sq, 1.0, b_big)
    for k, v in zip(names, per_layer):
        estimator.update_two_batch(v / n, layers[k][1], 1.0, b_big, layer=k)
    return folded, int(round(n))


def micro_batch(estimator: GNSEstimator, small: torch.Tensor, big: torch.Tensor, sizes: list[int],
                groups: dict[str, list[int]], world: int = 1, group=None) -> tuple[bool, int]:
    """``small``: (k, P) each micro-batch's mean-gradient ‖ḡ_k‖² per parameter, ``big``: (P,) ‖ḡ‖² of the
    step's mean gradient, ``sizes`` the k micro-batch sizes; ``groups``: per-layer columns, folded per
    layer too. On a process group with a plain model (gradients averaged by a DDP wrapper elsewhere),
    every replica's micro-batches by one all-reduce of [Σ ‖ḡ_k‖², Σ 1/b_k, count, examples, per layer]."""
    k = small.shape[0]
    t = torch.tensor([float(small.sum()), sum(1.0 / b for b in sizes), float(k), float(sum(sizes)),
                      *(float(small[:, c].sum()) for c in groups.values())], dtype=torch.float64)
    if world > 1:
        t = t.to(comm_device(group))
        dist.all_reduce(t, group=group)
        t = t.cpu()
    n, h = float(t[2]), float(t[2]) / float(t[1])         # micro-batches, their harmonic mean size
    folded = estimator.update_two_batch(float(t[0]) / n, float(big.sum()), h, n * h)
    for i, (name, cols) in enumerate(groups.items()):
        estimator.update_two_batch(float(t[4 + i]) / n, float(big[cols].sum()), h, n * h, layer=name)
    return folded, int(round(float(t[3])))
