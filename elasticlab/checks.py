"""Argument checks shared by the package's public entry points (the simulator, the elastic job): a finite
number, a whole number, each a ValueError '``name`` must be ``need``, got ``value``'. Strict: a bool or a
string is not a number here (the command line's argparse converts its flags before they get here). Imports
nothing heavy, so the CLI can check its flags before loading numpy-heavy modules."""
from __future__ import annotations

import math
from numbers import Real

__all__ = ["number", "whole", "seconds"]


def _real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def number(name, value, ok=lambda x: True, need="a finite number"):
    """``value`` as a float when it is a finite real number (not a bool, not a string) passing ``ok``."""
    if not (_real(value) and math.isfinite(value) and ok(float(value))):
        raise ValueError(f"{name} must be {need}, got {value!r}")
    return float(value)


def whole(name, value, least: int, need: str | None = None, most: int | None = None) -> int:
    """``value`` as an int when it is a whole real number in [``least``, ``most``] (2 or 2.0; not a bool or a
    string)."""
    if not (_real(value) and math.isfinite(value) and float(value).is_integer() and value >= least
            and (most is None or value <= most)):
        bounds = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise ValueError(f"{name} must be {need or f'a whole number {bounds}'}, got {value!r}")
    return int(value)


def seconds(name, value, zero_ok: bool = False) -> float:
    """A duration: a finite number of seconds > 0 (``zero_ok``: >= 0)."""
    if zero_ok:
        return number(name, value, lambda x: x >= 0, "a finite number of seconds >= 0")
    return number(name, value, lambda x: x > 0, "a finite number of seconds > 0")
