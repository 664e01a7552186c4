"""The simulator's argument checks, one place for each (the engine, the workloads, the trace workloads and
the CLI call these, the CLI with its flag names), on :mod:`elasticlab.checks`' number checks; imports nothing
heavy, so the CLI can check its flags before loading numpy-heavy modules."""
from __future__ import annotations

from elasticlab.checks import number, seconds, whole

__all__ = ["check_interval", "check_restart_delay", "check_max_time", "check_limit",
           "check_hours", "check_load", "check_seed"]


def check_interval(value, name="interval"):
    return seconds(name, value)


def check_restart_delay(value, name="restart_delay"):
    return seconds(name, value, zero_ok=True)


def check_max_time(value, name="max_time"):
    return None if value is None else seconds(name, value)


def check_hours(value, name, allow_zero=False):
    """A trace window's start (>= 0) or length (> 0), in hours."""
    if allow_zero:
        return number(name, value, lambda x: x >= 0, "a finite number of hours >= 0")
    return number(name, value, lambda x: x > 0, "a finite number of hours > 0")


def check_load(value, name="load"):
    return number(name, value, lambda x: x > 0, "a finite load factor > 0")


def check_seed(value, name="seed"):
    return whole(name, value, 0)


def check_limit(limit, name="limit"):
    """``limit`` as an int >= 1 (or None); a ValueError naming it otherwise."""
    return None if limit is None else whole(name, limit, 1, "a whole number of jobs >= 1")
