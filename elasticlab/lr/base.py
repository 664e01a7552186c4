"""The scaling-rule interface: a rule maps the batch scale ``S = M / M0`` to an LR multiplier.

A rule is any object with ``multiplier(scale) -> float`` and ``gain(scale) -> float`` (the statistical
progress of one step at scale S, in steps at M0; AdaScale's r, Pollux's S * E). Rules register
themselves by name in :data:`RULES` so callers can say ``rule="sqrt"``.
"""
from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

RULES: dict[str, type] = {}


@runtime_checkable
class ScalingRule(Protocol):
    def multiplier(self, scale: float) -> float: ...

    def gain(self, scale: float) -> float: ...


def register(name: str):
    """Class decorator: make a rule constructible as ``get_rule(name)``."""

    def deco(cls):
        RULES[name] = cls
        cls.name = name
        return cls

    return deco


def get_rule(rule, **kwargs) -> ScalingRule:
    """A rule instance from a name in :data:`RULES` or an instance (returned as is)."""
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown LR scaling rule {rule!r}; known: {sorted(RULES)}")
        return RULES[rule](**kwargs)
    if not isinstance(rule, ScalingRule):
        raise TypeError(f"a scaling rule needs multiplier(scale) and gain(scale); got {rule!r}")
    return rule


def check_scale(scale) -> float:
    scale = float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"batch scale M/M0 must be a positive finite number, got {scale}")
    return scale
