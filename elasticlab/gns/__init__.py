"""Per-example gradient norms and the gradient noise scale (McCandlish et al. 2018; Gray et al. 2024).

- :class:`PerSampleGradNorms` (norms.py): per-example ‖∇θ ℓ_i‖² from layer inputs and output gradients.
- :mod:`~elasticlab.gns.registry`: per-layer rules keyed by module type (:func:`register_rule`);
  :mod:`~elasticlab.gns.layers`: one module per layer family, each holding its hook rule and its fused
  backward (gradients and norms in one pass) and registering them.
- :mod:`~elasticlab.gns.kernels`: row-norm / Gram / outer-product / LayerNorm kernels (torch.ops.elasticlab.*)
  and their PyTorch references.
- :class:`GNSEstimator` (estimator.py): per-example and two-batch estimators, B_simple, Pollux's (sqr, var).
- :mod:`~elasticlab.gns.ddp`: combining replicas under DistributedDataParallel.
- :mod:`~elasticlab.gns.choices`: the timed per-shape form choices saved, loaded and agreed across ranks.
- :class:`GNSMonitor` (monitor.py): the GNS of an existing training loop, estimator form chosen by itself.
- :mod:`~elasticlab.gns.experiments`: P5-T1/T2 estimator experiments on synthetic linear regression, P5-T3
  (steps/examples trade-off of SGD) and P5-T5 (LayerNorm-only GNS against the total).
"""
from elasticlab.gns.estimator import GNSEstimator, per_example_estimates, two_batch_estimates
from elasticlab.gns.monitor import GNSMonitor
from elasticlab.gns.norms import PerSampleGradNorms
from elasticlab.gns.registry import RULES, Rule, covered_params, register_rule, rule_for

__all__ = ["GNSEstimator", "GNSMonitor", "PerSampleGradNorms", "RULES", "Rule", "covered_params",
           "per_example_estimates", "register_rule", "rule_for", "two_batch_estimates"]
