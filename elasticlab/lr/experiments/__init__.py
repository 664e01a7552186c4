"""Reproductions of the learning-rate papers as functions returning numbers (reused by ``elasticlab
reproduce``; targets in ``shared/reference/papers.md``), one module per setting:

- :mod:`.nqm_runs` -- on the noisy quadratic model: P2-T1/T2 (Dynamic SGD vs the momentum-noise spike after a
  batch jump, Lin et al. 2019) and P6-T2/T3 (AdaScale's scale invariance, Johnson et al. 2020);
- :mod:`.digits` -- P2-T3, Dynamic SGD on scikit-learn's digits with workers emulated by accumulation;
- :mod:`.pl_bound` -- P6-T4, AdaScale's Thm. 2 bounds on a PL quadratic.
"""
from elasticlab.lr.experiments.digits import (
    DIGITS_VARIANTS,
    accumulate_worker_grads,
    batched_mlp,
    batched_mlp_forward,
    digits_elastic_run,
    digits_splits,
    elastic_digits,
)
from elasticlab.lr.experiments.nqm_runs import (
    SPIKE_VARIANTS,
    adascale_invariance,
    adascale_run,
    batch_jump_run,
    elastic_adascale,
    momentum_spike,
)
from elasticlab.lr.experiments.pl_bound import (
    adascale_bound_check,
    linear_scaling_floor,
    pl_quadratic_run,
    sgd_pl_bound,
)

__all__ = [
    "SPIKE_VARIANTS", "batch_jump_run", "momentum_spike", "adascale_run", "adascale_invariance",
    "elastic_adascale", "DIGITS_VARIANTS", "digits_splits", "batched_mlp", "batched_mlp_forward",
    "accumulate_worker_grads", "digits_elastic_run", "elastic_digits", "sgd_pl_bound", "pl_quadratic_run",
    "linear_scaling_floor", "adascale_bound_check",
]
