"""``nn.PReLU``: y = max(0, x) + a·min(0, x) with one learned slope a, or one per channel (dim 1; He et al.
2015): ∇a ℓ_b = Σ δ_b ⊙ min(0, x_b) over the positions sharing the slope, computed in the wider dtype. Hook
rule only.
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import batched, cast, wider
from elasticlab.gns.registry import register_rule


def prelu_norms(module: nn.PReLU, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: ‖Σ δ_b ⊙ min(0, x_b)‖² per example, summed per channel (or over all, one slope)."""
    x = inputs[0]
    batched(module, x, 2)
    dt = kernels.acc_dtype(wider(x, d))
    B = x.shape[0]
    s = cast(d, dt) * cast(x, dt).clamp(max=0)
    per = s.reshape(B, 1, -1) if module.num_parameters == 1 else s.reshape(B, s.shape[1], -1)
    return {"weight": kernels.row_sq(per.sum(2))}


register_rule(nn.PReLU, prelu_norms, params=("weight",))
