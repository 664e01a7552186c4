"""Dynamic SGD (Lin et al., arXiv:1904.12043): ramp the LR multiplier after a batch-size change.

When the global batch changes by a factor k at step t0, the multiplier moves linearly from its old value
to the rule's new one over T steps, ``m(t0 + tau) = m_old + (m_new - m_old) * tau / T`` for tau < T
(T = ``steps``, default ``steps_per_k * max(k, 1/k)``, i.e. 8k for growth). The stale small-batch noise
in the momentum buffer is then not amplified k-fold (Lin et al.'s diagnosis). ``momentum`` picks what
happens to the optimizer's momentum at a change: ``"keep"``, ``"reset"`` (zero the buffers), or
``"correct"`` (rescale them by lr_old / lr_new at every LR change: Goyal et al. 2017's momentum
correction).
"""
from __future__ import annotations

import math

from elasticlab.checks import number, whole

from .base import register

MOMENTUM_MODES = ("keep", "reset", "correct")


@register("dynamic_sgd", label="Dynamic SGD ramp to linear (Lin et al. 2019)", ramp_to="linear", order=40)
class DynamicSGD:
    def __init__(self, steps: int | None = None, steps_per_k: float = 8.0, momentum: str = "keep"):
        if steps is not None:
            whole("steps", steps, 0, "a non-negative integer or None")
        number("steps_per_k", steps_per_k, lambda x: x >= 0, "a finite number >= 0")
        if momentum not in MOMENTUM_MODES:
            raise ValueError(f"momentum must be one of {MOMENTUM_MODES}, got {momentum!r}")
        self.steps = None if steps is None else int(steps)
        self.steps_per_k = float(steps_per_k)
        self.momentum = momentum
        self.start_step = 0
        self.length = 0
        self.start_multiplier = 1.0

    def ramp_length(self, k: float) -> int:
        """T for a batch change by factor k (> 0)."""
        if not (k > 0 and math.isfinite(k)):
            raise ValueError(f"batch change factor k must be positive, got {k}")
        if self.steps is not None:
            return self.steps
        return int(round(self.steps_per_k * max(k, 1.0 / k)))

    def begin(self, step: int, k: float, current_multiplier: float) -> None:
        """A batch change by factor ``k`` happens before optimizer step ``step``."""
        self.start_step = int(step)
        self.length = self.ramp_length(k)
        self.start_multiplier = float(current_multiplier)

    def active(self, step: int) -> bool:
        return step - self.start_step < self.length

    def __call__(self, step: int, target: float) -> float:
        """The multiplier to use at ``step`` given the rule's current ``target`` multiplier."""
        tau = step - self.start_step
        if tau >= self.length or tau < 0:
            return target
        return self.start_multiplier + (target - self.start_multiplier) * tau / self.length

    def state_dict(self) -> dict:
        return {"steps": self.steps, "steps_per_k": self.steps_per_k, "momentum": self.momentum,
                "start_step": self.start_step, "length": self.length,
                "start_multiplier": self.start_multiplier}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self.steps_per_k = float(state["steps_per_k"])
        self.momentum = state["momentum"]
        self.start_step = int(state["start_step"])
        self.length = int(state["length"])
        self.start_multiplier = float(state["start_multiplier"])

    def __repr__(self):
        t = self.steps if self.steps is not None else f"{self.steps_per_k:g}k"
        return f"DynamicSGD(T={t}, momentum={self.momentum!r})"
