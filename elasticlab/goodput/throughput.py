"""Pollux's throughput model THROUGHPUT (Qiao et al., OSDI 2021, §3.2): T_grad, T_sync, T_iter.

Notation: ``K`` GPUs (replicas), ``N`` nodes, ``b`` per-GPU micro-batch, ``s`` accumulation steps, so the
global batch is ``M = K * b * (s + 1)`` (:func:`global_batch`). Each formula is written once here, as a
function of the raw parameters, so that :class:`ThroughputModel` and the fit's differentiable prediction
(:func:`elasticlab.goodput.fit._predict`) compute the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from numbers import Real

import numpy as np

__all__ = ["ThroughputModel", "global_batch"]


def global_batch(gpus, per_gpu_batch, accum_steps):
    """``M = K * b * (s + 1)``, samples per optimizer step."""
    return gpus * per_gpu_batch * (accum_steps + 1.0)


def _grad_time(alpha_grad, beta_grad, per_gpu_batch):
    """``T_grad(b) = alpha_grad + beta_grad * b``."""
    return alpha_grad + beta_grad * per_gpu_batch


def _sync_terms(nodes, gpus):
    """``(max(K - 2, 0), N > 1, K > 1)``: what T_sync depends on (and its derivatives, in the fit)."""
    return np.maximum(gpus - 2.0, 0.0), nodes > 1, gpus > 1


def _sync_time(alpha_local, beta_local, alpha_node, beta_node, nodes, gpus):
    """T_sync: 0 on one GPU, ``alpha_local + beta_local * (K - 2)`` on one node, else the node terms."""
    extra, multi, synced = _sync_terms(nodes, gpus)
    return np.where(synced, np.where(multi, alpha_node + beta_node * extra, alpha_local + beta_local * extra),
                    0.0)


def _overlap(t_grad, t_sync, gamma):
    """``(a^g + c^g)^(1/g)`` computed as ``m * ((a/m)^g + (c/m)^g)^(1/g)``, m = max(a, c), to avoid
    underflow for small times and large gamma."""
    if gamma == 1.0:
        return t_grad + t_sync
    hi = np.maximum(t_grad, t_sync)
    lo = np.minimum(t_grad, t_sync)
    safe = np.where(hi > 0, hi, 1.0)
    return hi * (1.0 + (lo / safe) ** gamma) ** (1.0 / gamma)


def _iter_time(t_grad, t_step, accum_steps):
    """``T_iter = s * T_grad + T_step`` (accumulation micro-steps do not sync)."""
    return accum_steps * t_grad + t_step


@dataclass(frozen=True)
class ThroughputModel:
    """Pollux's throughput model theta_sys; times in seconds, batches in samples.

    ``T_grad(b) = alpha_grad + beta_grad * b`` (one forward/backward of a micro-batch);
    ``T_sync`` = 0 on one GPU, ``alpha_local + beta_local * (K - 2)`` on one node, else
    ``alpha_node + beta_node * (K - 2)``; an optimizer step overlaps them,
    ``T_step = (T_grad^gamma + T_sync^gamma)^(1/gamma)`` (gamma = 1: no overlap, gamma -> inf: max);
    ``T_iter = s * T_grad + T_step`` (accumulation micro-steps do not sync).
    """

    alpha_grad: float
    beta_grad: float
    alpha_local: float = 0.0
    beta_local: float = 0.0
    alpha_node: float = 0.0
    beta_node: float = 0.0
    gamma: float = 1.0

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, Real) or not math.isfinite(v):
                raise ValueError(f"ThroughputModel.{f.name} must be a finite number, got {v!r}")
            if f.name != "gamma" and v < 0:
                raise ValueError(f"ThroughputModel.{f.name} must be >= 0 (a time), got {v}")
        if not 1.0 <= self.gamma:
            raise ValueError(f"ThroughputModel.gamma must be >= 1, got {self.gamma}")

    def to_array(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=float)

    @classmethod
    def from_array(cls, x) -> ThroughputModel:
        return cls(*(float(v) for v in np.asarray(x, dtype=float).ravel()))

    def as_dict(self) -> dict:
        return asdict(self)

    def grad_time(self, per_gpu_batch):
        """T_grad(b) = alpha_grad + beta_grad * b."""
        return _grad_time(self.alpha_grad, self.beta_grad, np.asarray(per_gpu_batch, dtype=float))

    def sync_time(self, nodes, gpus):
        """T_sync(N, K), by the slowest link the job spans."""
        return _sync_time(self.alpha_local, self.beta_local, self.alpha_node, self.beta_node,
                          np.asarray(nodes, dtype=float), np.asarray(gpus, dtype=float))

    def step_time(self, nodes, gpus, per_gpu_batch):
        """T_iter without accumulation: the overlapped optimizer step."""
        return _overlap(self.grad_time(per_gpu_batch), self.sync_time(nodes, gpus), self.gamma)

    def iter_time(self, nodes, gpus, per_gpu_batch, accum_steps=0):
        """``T_iter = s * T_grad + T_step``, broadcast over all arguments."""
        t_grad = self.grad_time(per_gpu_batch)
        t_step = _overlap(t_grad, self.sync_time(nodes, gpus), self.gamma)
        return _iter_time(t_grad, t_step, np.asarray(accum_steps, dtype=float))

    def throughput(self, nodes, gpus, per_gpu_batch, accum_steps=0):
        """Samples per second, ``M / T_iter``."""
        gpus = np.asarray(gpus, dtype=float)
        b = np.asarray(per_gpu_batch, dtype=float)
        s = np.asarray(accum_steps, dtype=float)
        return global_batch(gpus, b, s) / self.iter_time(nodes, gpus, b, s)
