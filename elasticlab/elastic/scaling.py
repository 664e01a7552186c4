"""The statistics and LR rule every worker carries, built from :mod:`elasticlab.gns` and :mod:`elasticlab.lr`.

* GNS: :class:`elasticlab.gns.GNSEstimator` fed, under DDP, by the replica two-batch form (McCandlish et
  al. App. A.1): each replica's local gradient norm (B_small = local batch, taken by
  :class:`elasticlab.gns.ddp.ReplicaGradNorms` before the all-reduce) against the all-reduced one
  (B_big = global batch).
* LR: :class:`elasticlab.lr.ElasticLR` with the job's rule, any job rule of the registry
  :data:`elasticlab.lr.RULES` (:func:`lr_rules`): ``constant`` (identity), ``linear``, ``sqrt``,
  ``adascale`` (AdaScale gain from the live GNS, Johnson et al. Eq. (2)) or ``dynamic_sgd`` (a ramp: linear
  scaling reached by the Dynamic-SGD ramp over ``ramp_per_k·k`` steps, Lin et al. 2019).
"""
from __future__ import annotations


def lr_rules() -> tuple[str, ...]:
    """The LR rules a job can name, in order (from :func:`elasticlab.lr.job_rules`)."""
    from elasticlab.lr import job_rules

    return job_rules()


def __getattr__(name):  # ``LR_RULES``, read from the registry when asked
    if name == "LR_RULES":
        return lr_rules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_gns(base_batch: int, beta: float = 0.99):
    from elasticlab.gns import GNSEstimator

    return GNSEstimator(beta=beta, init_batch_size=int(base_batch))


def make_lr(optimizer, rule: str, base_batch: int, gns=None, ramp_per_k: float = 8.0):
    """An :class:`~elasticlab.lr.ElasticLR` for one of :func:`lr_rules`; a ramp rule is built as
    ``cls(steps_per_k=ramp_per_k)`` and ramps to the multiplier of its ``ramp_to`` rule."""
    from elasticlab.lr import ElasticLR, rule_info

    info = rule_info(rule)
    if info.is_ramp:
        ramp = info.cls(steps_per_k=ramp_per_k)
        return ElasticLR(optimizer, base_batch, rule=info.ramp_to, ramp=ramp, gns=gns)
    return ElasticLR(optimizer, base_batch, rule=info.name, gns=gns)
