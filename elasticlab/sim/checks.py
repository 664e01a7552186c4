"""The simulator's argument checks, one place for each (the engine, the workloads, the trace workloads and
the CLI call these, the CLI with its flag names); imports nothing heavy, so the CLI can check its flags
before loading numpy-heavy modules."""
from __future__ import annotations

import math

__all__ = ["number", "check_interval", "check_restart_delay", "check_max_time", "check_limit",
           "check_hours", "check_load", "check_seed"]


def number(name, value, ok, need):
    """``value`` as a float when it is a finite number (not a bool) passing ``ok``; else a ValueError
    '``name`` must be ``need``, got ``value``'."""
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be {need}, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(x) or not ok(x):
        raise ValueError(f"{name} must be {need}, got {value!r}")
    return x


def check_interval(value, name="interval"):
    return number(name, value, lambda x: x > 0, "a finite number of seconds > 0")


def check_restart_delay(value, name="restart_delay"):
    return number(name, value, lambda x: x >= 0, "a finite number of seconds >= 0")


def check_max_time(value, name="max_time"):
    return None if value is None else number(name, value, lambda x: x > 0, "a finite number of seconds > 0")


def check_hours(value, name, allow_zero=False):
    """A trace window's start (>= 0) or length (> 0), in hours."""
    if allow_zero:
        return number(name, value, lambda x: x >= 0, "a finite number of hours >= 0")
    return number(name, value, lambda x: x > 0, "a finite number of hours > 0")


def check_load(value, name="load"):
    return number(name, value, lambda x: x > 0, "a finite load factor > 0")


def check_seed(value, name="seed"):
    try:
        ok = not isinstance(value, bool) and float(value) == int(value) and int(value) >= 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return int(value)


def check_limit(limit, name="limit"):
    """``limit`` as an int >= 1 (or None); a ValueError naming it otherwise."""
    if limit is None:
        return None
    try:
        ok = not isinstance(limit, bool) and float(limit) == int(limit) and int(limit) >= 1
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a whole number of jobs >= 1, got {limit!r}")
    return int(limit)
