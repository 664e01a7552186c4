"""The scheduler's objective: Pollux's FITNESS_p power mean over jobs' speedups (Eq. (9)) and the
re-allocation penalty ``max(T - R delta, 0) / (T + delta)`` (§4.2) -- the home the policies import from.

One copy: the implementation is :mod:`elasticlab.goodput.objective`, in the lower layer, so that
``alloc`` imports ``goodput`` and never the other way round (no import cycle, no import running back up the
floors of ARCHITECTURE.md) while ``from elasticlab.goodput import fitness, restart_penalty`` keeps working.
"""
from elasticlab.goodput.objective import fitness, restart_penalty

__all__ = ["fitness", "restart_penalty"]
