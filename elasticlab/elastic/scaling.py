"""The statistics and LR rule every worker carries, built from :mod:`elasticlab.gns` and :mod:`elasticlab.lr`.

* GNS: :class:`elasticlab.gns.GNSEstimator` fed, under DDP, by the replica two-batch form (McCandlish et
  al. App. A.1): each replica's local gradient norm (B_small = local batch, taken by
  :class:`elasticlab.gns.ddp.ReplicaGradNorms` before the all-reduce) against the all-reduced one
  (B_big = global batch).
* LR: :class:`elasticlab.lr.ElasticLR` with the job's rule: ``constant`` (identity), ``linear``,
  ``sqrt``, ``adascale`` (AdaScale gain from the live GNS, Johnson et al. Eq. (2)) or ``dynamic_sgd``
  (linear scaling reached by the Dynamic-SGD ramp over ``ramp_per_k·k`` steps, Lin et al. 2019).
"""
from __future__ import annotations

LR_RULES = ("constant", "linear", "sqrt", "adascale", "dynamic_sgd")


def make_gns(base_batch: int, beta: float = 0.99):
    from elasticlab.gns import GNSEstimator

    return GNSEstimator(beta=beta, init_batch_size=int(base_batch))


def make_lr(optimizer, rule: str, base_batch: int, gns=None, ramp_per_k: float = 8.0):
    """An :class:`~elasticlab.lr.ElasticLR` for one of :data:`LR_RULES`."""
    from elasticlab.lr import DynamicSGD, ElasticLR

    if rule not in LR_RULES:
        raise ValueError(f"unknown LR rule {rule!r}; choose one of {LR_RULES}")
    if rule == "dynamic_sgd":
        ramp = DynamicSGD(steps_per_k=ramp_per_k)
        return ElasticLR(optimizer, base_batch, rule="linear", ramp=ramp, gns=gns)
    return ElasticLR(optimizer, base_batch, rule="identity" if rule == "constant" else rule, gns=gns)
