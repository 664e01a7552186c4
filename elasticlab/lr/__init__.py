"""Learning-rate rules for elastic batch sizes: linear, square-root, AdaScale (Johnson et al. 2020),
Dynamic SGD ramps (Lin et al. 2019), scale-invariant progress, and :class:`ElasticLR`, the wrapper that
composes them with any torch optimizer and its base schedule."""
from .adascale import (
    AdaScale,
    AdaScaleEstimator,
    adascale_moments,
    adascale_moments_from_norms,
    gain_from_noise_scale,
    gain_ratio,
)
from .base import RULES, RuleInfo, ScalingRule, get_rule, job_rules, register, rule_info
from .dynamic_sgd import MOMENTUM_MODES, DynamicSGD
from .linear import IdentityScaling, LinearScaling
from .progress import ScaleInvariantProgress
from .sqrt import SqrtScaling
from .wrapper import ElasticLR

__all__ = [
    "AdaScale",
    "AdaScaleEstimator",
    "DynamicSGD",
    "ElasticLR",
    "IdentityScaling",
    "LinearScaling",
    "MOMENTUM_MODES",
    "RULES",
    "RuleInfo",
    "ScaleInvariantProgress",
    "ScalingRule",
    "SqrtScaling",
    "adascale_moments",
    "adascale_moments_from_norms",
    "gain_from_noise_scale",
    "gain_ratio",
    "get_rule",
    "job_rules",
    "register",
    "rule_info",
]


def _discover() -> None:
    """Import every module of this package (not the ``experiments`` subpackage) so that a rule defined in a
    new module registers itself in :data:`RULES`: adding an LR rule is adding one module."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_discover()
