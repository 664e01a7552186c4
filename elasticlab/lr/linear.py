"""Linear scaling (Goyal et al. 2017; Krizhevsky 2014): LR multiplier = S = M / M0."""
from __future__ import annotations

from .base import check_scale, register


@register("linear", label="linear scaling (Goyal et al. 2017)", order=10)
class LinearScaling:
    """``multiplier(S) = S``. Counts every step as S steps at M0 (the perfect-scaling assumption)."""

    def multiplier(self, scale: float) -> float:
        return check_scale(scale)

    def gain(self, scale: float) -> float:
        return check_scale(scale)

    def __repr__(self):
        return "LinearScaling()"


@register("constant", label="constant (base LR)", order=0)
@register("identity", job_rule=False)
class IdentityScaling:
    """Keep the base LR whatever the batch (``multiplier = 1``); a step counts as S steps at M0."""

    def multiplier(self, scale: float) -> float:
        check_scale(scale)
        return 1.0

    def gain(self, scale: float) -> float:
        return check_scale(scale)

    def __repr__(self):
        return "IdentityScaling()"
