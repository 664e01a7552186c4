"""``nn.InstanceNorm1d/2d/3d`` with affine parameters: per-example gradients of γ and β.

Normalised by each example's own statistics (training mode, or ``track_running_stats=False``, the default),
an InstanceNorm is a GroupNorm with one channel per group (Ulyanov et al. 2016): the examples do not
interact, and the per-example gradients are :mod:`.groupnorm`'s. In eval mode with running statistics it is
a per-channel affine map, and they are :mod:`.batchnorm`'s eval-mode ones. Hook rule only.
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns.layers.batchnorm import batchnorm_norms
from elasticlab.gns.layers.common import batched
from elasticlab.gns.layers.groupnorm import group_affine_norms
from elasticlab.gns.registry import register_rule


def instancenorm_norms(module: nn.Module, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: instance statistics as GroupNorm with C groups; running statistics as eval BatchNorm."""
    x = inputs[0]
    batched(module, x, module._get_no_batch_dim() + 1)
    if module.training or not module.track_running_stats or module.running_mean is None:
        return group_affine_norms(x, d, x.shape[1], module.eps, need)
    return batchnorm_norms(module, inputs, d, need)


for _cls in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
    register_rule(_cls, instancenorm_norms)
