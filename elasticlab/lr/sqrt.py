"""Square-root scaling (Krizhevsky 2014; Hoffer et al. 2017): LR multiplier = sqrt(M / M0).

Pollux uses it for Adam/AdamW jobs (BERT, NeuMF)."""
from __future__ import annotations

import math

from .base import check_scale, register


@register("sqrt", label="square-root scaling", order=20)
class SqrtScaling:
    """``multiplier(S) = sqrt(S)``; a step counts as S steps at M0 (perfect-scaling assumption)."""

    def multiplier(self, scale: float) -> float:
        return math.sqrt(check_scale(scale))

    def gain(self, scale: float) -> float:
        return check_scale(scale)

    def __repr__(self):
        return "SqrtScaling()"
