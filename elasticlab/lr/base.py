"""The scaling-rule interface and the registry of LR rules.

A scaling rule maps the batch scale ``S = M / M0`` to an LR multiplier: any object with
``multiplier(scale) -> float`` and ``gain(scale) -> float`` (the statistical progress of one step at
scale S, in steps at M0; AdaScale's r, Pollux's S * E). A ramp (Dynamic SGD) moves the multiplier to a
scaling rule's value over some steps after a batch change.

Every rule registers itself where it is defined, with :func:`register`, in :data:`RULES` (name ->
:class:`RuleInfo`), the one list of LR rules: ``get_rule("sqrt")`` builds a scaling rule,
:func:`job_rules` lists, in order, the rules an elastic job can name (read by
:func:`elasticlab.elastic.scaling.make_lr`, :class:`elasticlab.cluster.JobSpec` and the job panel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class RuleInfo:
    """One entry of :data:`RULES`.

    ``cls``: the scaling-rule class (built by :func:`get_rule`), or for a ramp the ramp class, built as
    ``cls(steps_per_k=...)`` and reaching the multiplier of the registered rule ``ramp_to``.
    ``needs_gns``: the rule is built with the job's live gradient statistics (``cls(stats=gns)``).
    ``job_rule``: offered to elastic jobs (``lr_rule=name``), in ``order`` (then registration order).
    """

    name: str
    cls: type
    label: str
    needs_gns: bool = False
    ramp_to: str | None = None
    job_rule: bool = True
    order: float = math.inf
    index: int = 0

    @property
    def is_ramp(self) -> bool:
        return self.ramp_to is not None


RULES: dict[str, RuleInfo] = {}


@runtime_checkable
class ScalingRule(Protocol):
    def multiplier(self, scale: float) -> float: ...

    def gain(self, scale: float) -> float: ...


def register(name: str, *, label: str | None = None, needs_gns: bool = False, ramp_to: str | None = None,
             job_rule: bool = True, order: float = math.inf):
    """Class decorator: put the class in :data:`RULES` as ``name`` (see :class:`RuleInfo` for the rest).

    Stacked decorators register one class under several names; ``cls.name`` is the innermost one."""

    def deco(cls):
        RULES[name] = RuleInfo(name, cls, label or name, needs_gns, ramp_to, job_rule, order, len(RULES))
        if "name" not in cls.__dict__:
            cls.name = name
        return cls

    return deco


def job_rules() -> tuple[str, ...]:
    """The names an elastic job's ``lr_rule`` can take, in the order the job panel shows them."""
    return tuple(r.name for r in sorted((r for r in RULES.values() if r.job_rule),
                                        key=lambda r: (r.order, r.index)))


def rule_info(name: str) -> RuleInfo:
    """The :data:`RULES` entry of an elastic job's rule ``name`` (ValueError if no job rule has it)."""
    if name not in job_rules():
        raise ValueError(f"unknown LR rule {name!r}; choose one of {job_rules()}")
    return RULES[name]


def get_rule(rule, **kwargs) -> ScalingRule:
    """A rule instance from a name in :data:`RULES` (not a ramp) or an instance (returned as is)."""
    if isinstance(rule, str):
        if rule not in RULES or RULES[rule].is_ramp:
            known = sorted(n for n, r in RULES.items() if not r.is_ramp)
            raise ValueError(f"unknown LR scaling rule {rule!r}; known: {known}")
        return RULES[rule].cls(**kwargs)
    if not isinstance(rule, ScalingRule):
        raise TypeError(f"a scaling rule needs multiplier(scale) and gain(scale); got {rule!r}")
    return rule


def needs_gns(rule) -> bool:
    """Whether ``rule`` (a name) is built with the job's gradient statistics (AdaScale)."""
    return isinstance(rule, str) and rule in RULES and RULES[rule].needs_gns


def check_scale(scale) -> float:
    scale = float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"batch scale M/M0 must be a positive finite number, got {scale}")
    return scale
