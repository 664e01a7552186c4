"""``nn.BatchNorm1d/2d/3d`` (and ``nn.SyncBatchNorm``) in eval mode: per-example gradients of γ and β.

With frozen statistics (eval mode with running statistics), x̂ = (x − running_mean)/sqrt(running_var + ε) is
per-example and the layer is an affine map per channel: ∇γ_c ℓ_b = Σ_s δ_{b,c,s} x̂_{b,c,s}, ∇β_c ℓ_b = Σ_s
δ_{b,c,s} over the positions s, (B, C) each. With batch statistics (training mode, or
``track_running_stats=False``) each example's output depends on the whole batch through the batch mean and
variance, so per-example gradients are not defined; the rule's ``check`` raises a ValueError at the forward.
Hook rule only (an eval-mode BatchNorm is cheap next to the layers around it).
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import batched, cast, wider
from elasticlab.gns.registry import register_rule


def uses_batch_stats(module: nn.Module) -> bool:
    """Whether BatchNorm normalises by the statistics of the batch (as ``_BatchNorm.forward`` decides)."""
    return module.training or module.running_mean is None or module.running_var is None


def batchnorm_check(module: nn.Module) -> None:
    """ValueError when the module normalises with batch statistics."""
    if not uses_batch_stats(module):
        return
    if module.track_running_stats and module.running_mean is not None:
        why = "in training mode"
        fix = "put the model (or this layer) in eval mode so that it uses its running statistics, "
    else:
        why, fix = "with track_running_stats=False (no running statistics, so in eval mode too)", ""
    raise ValueError(
        f"per-example gradients are not defined for {type(module).__name__} {why}: it normalises with the "
        "statistics of the batch, which couple the examples (each example's output, and so its loss, depends "
        f"on the whole batch). To measure per-example gradient norms, {fix}freeze its affine parameters "
        "(weight/bias requires_grad_(False)), or replace BatchNorm by GroupNorm (Opacus' "
        "ModuleValidator.fix, or torchvision's norm_layer=lambda c: nn.GroupNorm(8, c)); "
        "torch.func.replace_all_batch_norm_modules_ is not enough, as it keeps the batch statistics")


def batchnorm_norms(module: nn.Module, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule (eval mode): Σ_s δ ⊙ x̂ (weight) and Σ_s δ (bias) per (example, channel)."""
    batchnorm_check(module)
    x = inputs[0]
    batched(module, x, 2)
    dt = kernels.acc_dtype(wider(x, d))
    B, C = x.shape[:2]
    x3, d3 = cast(x, dt).reshape(B, C, -1), cast(d, dt).reshape(B, C, -1)
    out = {}
    if "weight" in need:
        inv = torch.rsqrt(module.running_var.to(dt) + module.eps)
        xhat = (x3 - module.running_mean.to(dt).unsqueeze(-1)) * inv.unsqueeze(-1)
        out["weight"] = kernels.row_sq((d3 * xhat).sum(-1))
    if "bias" in need:
        out["bias"] = kernels.row_sq(d3.sum(-1))
    return out


for _cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
    register_rule(_cls, batchnorm_norms, check=batchnorm_check)
