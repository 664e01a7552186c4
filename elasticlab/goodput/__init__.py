"""Pollux's goodput model (Qiao et al., OSDI 2021): throughput x statistical efficiency.

Everything here is vectorised numpy: the allocator evaluates thousands of (nodes, GPUs) candidates per
round. Notation: ``M0`` initial global batch, ``M`` global batch per optimizer step, ``K`` GPUs (replicas),
``N`` nodes, ``b`` per-GPU micro-batch, ``s`` accumulation steps, so ``M = K * b * (s + 1)``.

- :mod:`.efficiency` -- Pollux's EFFICIENCY_t, ``E(M) = (phi + M0) / (phi + M)``; :func:`gain`,
  :func:`noise_scale`, :class:`GradParams`;
- :mod:`.throughput` -- :class:`ThroughputModel`, Pollux's THROUGHPUT (T_grad, T_sync, T_iter), seven
  parameters ``theta_sys``;
- :mod:`.fit` -- :func:`fit_throughput_model`, RMSLE fit under bounds (L-BFGS-B) with the prior-driven
  pinning of parameters that the observations cannot identify yet (Pollux's prior-driven exploration);
- :mod:`.function` -- :func:`goodput` (the product, written once) and :class:`GoodputFunction`: the agent's
  ``(b, s)`` choice and speedups for the scheduler;
- :mod:`.objective` -- the scheduler's power-mean objective FITNESS_p (:func:`fitness`) and
  :func:`restart_penalty`; the allocator imports them as :mod:`elasticlab.alloc.objective`.

Formulas as restated in shared/reference/papers.md (P4) and pollux-artifact.md §1.
"""
from elasticlab.goodput.efficiency import GradParams, efficiency, gain, noise_scale
from elasticlab.goodput.fit import OBSERVATION_COLUMNS, fit_throughput_model
from elasticlab.goodput.function import GoodputFunction, goodput
from elasticlab.goodput.objective import fitness, restart_penalty
from elasticlab.goodput.throughput import ThroughputModel, global_batch

__all__ = [
    "GradParams",
    "ThroughputModel",
    "GoodputFunction",
    "efficiency",
    "gain",
    "noise_scale",
    "fit_throughput_model",
    "goodput",
    "global_batch",
    "fitness",
    "restart_penalty",
    "OBSERVATION_COLUMNS",
]

# private names kept importable from here: tests check the fit's gradient (_objective) and input parsing
# (_as_observations); benchmarks/bench_goodput.py clears the candidate cache (the same dict object)
from elasticlab.goodput.fit import _as_observations as _as_observations  # noqa: E402
from elasticlab.goodput.fit import _objective as _objective  # noqa: E402
from elasticlab.goodput.function import _CANDIDATE_CACHE as _CANDIDATE_CACHE  # noqa: E402
