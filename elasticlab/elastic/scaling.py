"""The job's statistics and LR scaling: the GNS estimator and the LR rule that workers carry.

Both come from :mod:`elasticlab.gns` and :mod:`elasticlab.lr` when those are importable; the small
fallbacks here implement the same formulas so the runtime works on its own:

* GNS, replica form (McCandlish et al. App. A.1, Pollux §3.1): with ``R`` replicas of local batch
  ``b`` (B_small) and the all-reduced gradient of batch ``R·b`` (B_big),
  ``|G|² ≈ (B_big|G_big|² − B_small|G_small|²)/(B_big − B_small)`` and
  ``tr Σ ≈ (|G_small|² − |G_big|²)/(1/B_small − 1/B_big)``; ``B_simple = tr Σ / |G|²`` from EMAs.
* LR factors at scale ``S = M/M0``: linear ``S``, sqrt ``√S``, AdaScale gain
  ``r = (σ² + |G|²)/(σ²/S + |G|²)`` (AdaScale Eq. (4)), Dynamic SGD linear ramp to ``S`` over
  ``8·k`` steps (Lin et al. 2019).
"""
from __future__ import annotations

import math


class ReplicaGNS:
    """Fallback GNS estimator (McCandlish App. A.1, two-batch form) with bias-corrected EMAs."""

    def __init__(self, beta: float = 0.99):
        self.beta = float(beta)
        self.g2 = 0.0
        self.trace = 0.0
        self.n = 0

    def update_replicas(self, local_sq_mean: float, global_sq: float, local_batch: float, count: int):
        if count < 2 or not (math.isfinite(local_sq_mean) and math.isfinite(global_sq)):
            return
        b_small, b_big = float(local_batch), float(local_batch) * count
        g2 = (b_big * global_sq - b_small * local_sq_mean) / (b_big - b_small)
        tr = (local_sq_mean - global_sq) / (1.0 / b_small - 1.0 / b_big)
        self.g2 = self.beta * self.g2 + (1 - self.beta) * g2
        self.trace = self.beta * self.trace + (1 - self.beta) * tr
        self.n += 1

    def _corr(self) -> float:
        return 1.0 - self.beta ** self.n if self.n else 1.0

    @property
    def grad_sq(self) -> float:
        return max(self.g2 / self._corr(), 0.0)

    @property
    def trace_cov(self) -> float:
        return max(self.trace / self._corr(), 0.0)

    @property
    def b_simple(self) -> float:
        if self.n == 0 or self.grad_sq <= 0:
            return float("nan")
        return self.trace_cov / self.grad_sq

    def state_dict(self) -> dict:
        return {"beta": self.beta, "g2": self.g2, "trace": self.trace, "n": self.n}

    def load_state_dict(self, s: dict) -> None:
        self.beta, self.g2 = float(s["beta"]), float(s["g2"])
        self.trace, self.n = float(s["trace"]), int(s["n"])


class GNSAdapter:
    """Feeds the replica norms of each step to :class:`elasticlab.gns.GNSEstimator` (or the fallback)."""

    def __init__(self):
        self.impl = ReplicaGNS()
        self.source = "elasticlab.elastic.scaling.ReplicaGNS"

    def update(self, local_sq_mean: float, global_sq: float, local_batch: float, count: int) -> None:
        self.impl.update_replicas(local_sq_mean, global_sq, local_batch, count)

    @property
    def b_simple(self) -> float:
        return float(self.impl.b_simple)

    def sqr_var(self, base_batch: int) -> tuple[float, float]:
        """Pollux's GradParams: ``sqr = |G|²``, ``var = tr Σ / M0`` (so ``φ = M0·var/sqr = B_simple``)."""
        return float(self.impl.grad_sq), float(self.impl.trace_cov) / base_batch

    def state_dict(self) -> dict:
        return self.impl.state_dict()

    def load_state_dict(self, s: dict) -> None:
        self.impl.load_state_dict(s)


class LRScaler:
    """Sets each step's LR to ``base_lr · factor`` for one of the rules named in the module docstring."""

    RULES = ("constant", "linear", "sqrt", "adascale", "dynamic_sgd")

    def __init__(self, optimizer, rule: str, base_batch: int, ramp_per_k: int = 8):
        if rule not in self.RULES:
            raise ValueError(f"unknown LR rule {rule!r}; choose one of {self.RULES}")
        self.optimizer, self.rule, self.base_batch = optimizer, rule, int(base_batch)
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.ramp_per_k = int(ramp_per_k)
        self.batch = self.base_batch
        self.ramp_from, self.ramp_to, self.ramp_len, self.ramp_t = 1.0, 1.0, 0, 0
        self.factor = 1.0

    def on_batch_change(self, new_global_batch: int) -> None:
        new_global_batch = int(new_global_batch)
        if new_global_batch == self.batch:
            return
        if self.rule == "dynamic_sgd":
            k = max(new_global_batch / self.batch, self.batch / new_global_batch)
            self.ramp_from, self.ramp_to = self.factor, new_global_batch / self.base_batch
            self.ramp_len, self.ramp_t = max(1, round(self.ramp_per_k * k)), 0
        self.batch = new_global_batch

    def step_factor(self, gns: GNSAdapter | None = None) -> float:
        scale = self.batch / self.base_batch
        if self.rule == "constant":
            f = 1.0
        elif self.rule == "linear":
            f = scale
        elif self.rule == "sqrt":
            f = math.sqrt(scale)
        elif self.rule == "adascale":
            f = 1.0
            if gns is not None:
                sqr, var = gns.sqr_var(self.base_batch)
                if sqr > 0 or var > 0:
                    f = (var + sqr) / (var / scale + sqr)
        else:  # dynamic_sgd
            if self.ramp_t < self.ramp_len:
                self.ramp_t += 1
                f = self.ramp_from + (self.ramp_to - self.ramp_from) * self.ramp_t / self.ramp_len
            else:
                f = scale
        self.factor = f
        return f

    def apply(self, gns: GNSAdapter | None = None) -> float:
        """Set the LR of this step on the optimizer; returns the LR of the first param group."""
        f = self.step_factor(gns)
        for g, lr0 in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = lr0 * f
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("rule", "base_batch", "base_lrs", "ramp_per_k", "batch",
                                              "ramp_from", "ramp_to", "ramp_len", "ramp_t", "factor")}

    def load_state_dict(self, s: dict) -> None:
        for k, v in s.items():
            setattr(self, k, list(v) if k == "base_lrs" else v)
