"""``nn.GroupNorm``: per-example gradients of its per-channel affine parameters.

Statistics are per (example, group), so examples do not interact and per-example gradients exist (Wu & He
2018; the usual replacement of BatchNorm under DP-SGD). With x̂ = (x − μ_{b,g})·rstd_{b,g} over the group of
channel c, ∇γ_c ℓ_b = Σ_s δ_{b,c,s} x̂_{b,c,s} and ∇β_c ℓ_b = Σ_s δ_{b,c,s} over the spatial positions s:
(B, C) each, so their norms are exact row norms. Inputs (B, C, *) of any spatial rank, (B, C) included.
Fused, the forward is ATen's ``native_group_norm`` (which returns μ and rstd), the input gradient ATen's own
backward, and the parameter gradients the batch sums of the per-example ones. Under autocast the layer runs
in float32, as LayerNorm's rule does. Fused calls go to the C++ autograd function
``elasticlab::group_norm_norms``, or under ``torch.compile`` to :class:`_GroupNormNorms`.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import (
    affine_norms,
    as_autocast_gives,
    batched,
    cast,
    norm_layer_buffer,
    wider,
)
from elasticlab.gns.registry import register_rule
from elasticlab.gns.sink import deliver, sink_for


def group_stats(x3: torch.Tensor, groups: int, eps: float):
    """(mean, rstd), each (B, G), of x3 (B, C, S) over each group's channels and positions."""
    var, mean = torch.var_mean(x3.reshape(x3.shape[0], groups, -1), dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def channel_per_example(x3: torch.Tensor, d3: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    """Per-example (Σ_s δ ⊙ x̂, Σ_s δ), each (B, C), for x3, d3 (B, C, S) and per-group mean/rstd (B, G)."""
    B, C = x3.shape[:2]
    G = mean.shape[1]
    xg = x3.reshape(B, G, -1)
    xhat = ((xg - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).view(B, C, -1)
    return (d3 * xhat).sum(-1), d3.sum(-1)


def group_affine_norms(x: torch.Tensor, d: torch.Tensor, groups: int, eps: float, need) -> dict:
    """Σ_s δ ⊙ x̂ (weight) and Σ_s δ (bias) per (example, channel), x̂ normalised over each example's groups,
    in the wider dtype: their squared norms."""
    dt = kernels.acc_dtype(wider(x, d))
    B, C = x.shape[:2]
    x3, d3 = cast(x, dt).reshape(B, C, -1), cast(d, dt).reshape(B, C, -1)
    mean, rstd = group_stats(x3, groups, eps)
    gw, gb = channel_per_example(x3, d3, mean, rstd)
    return affine_norms(gw, gb, need)


def groupnorm_norms(module: nn.GroupNorm, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: :func:`group_affine_norms` over the module's groups."""
    batched(module, inputs[0], 2)
    return group_affine_norms(inputs[0], d, module.num_groups, module.eps, need)


def memory_format(x: torch.Tensor) -> torch.memory_format:
    """Channels-last (3d) for a tensor laid out so, else contiguous (ATen's ``suggest_memory_format``)."""
    for dim, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if x.dim() == dim and not x.is_contiguous() and x.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


class _GroupNormNorms(torch.autograd.Function):
    """y = native_group_norm(x); backward: ATen's input gradient, Σ_b of the per-example (B, C) parameter
    gradients, and their norms."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, slot, sink=None):
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        ctx.sink = None if sink is None else sink.dtype
        if torch.is_autocast_enabled(x.device.type):          # run in float32, as autocast's group_norm would
            dt = torch.promote_types(x.dtype, torch.float32)
            x, weight, bias = cast(x, dt), cast(weight, dt), cast(bias, dt)
        # The layout ATen's group_norm gives its kernels: channels-last kept on the CPU, contiguous elsewhere.
        ctx.fmt = memory_format(x) if x.device.type in ("cpu", "xpu") else torch.contiguous_format
        x = x.contiguous(memory_format=ctx.fmt)
        B, C = x.shape[:2]
        hw = math.prod(x.shape[2:])
        with torch.autocast(x.device.type, enabled=False):
            out, mean, rstd = torch.native_group_norm(x, weight, bias, B, C, hw, groups, eps)
        ctx.slot, ctx.groups, ctx.hw, ctx.eps = slot, groups, hw, eps
        ctx.save_for_backward(x, weight, mean, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w, mean, rstd = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g = cast(g, x.dtype).contiguous(memory_format=ctx.fmt)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        B, C = x.shape[:2]
        gx = None
        if need_x:
            gx = torch.ops.aten.native_group_norm_backward(g, x, mean, rstd, w, B, C, ctx.hw, ctx.groups,
                                                           [True, False, False])[0]
        norms, gw, gb = {}, None, None
        if need_w or need_b:
            acc = kernels.acc_dtype(x.dtype)
            x3, g3 = cast(x, acc).reshape(B, C, -1), cast(g, acc).reshape(B, C, -1)
            if acc != x.dtype:                     # ATen's statistics of half inputs are half: recompute
                mean, rstd = group_stats(x3, ctx.groups, ctx.eps)
            pw, pb = channel_per_example(x3, g3, mean, rstd)
            if need_w:
                gw, norms["weight"] = cast(pw.sum(0), w_dtype), kernels.row_sq(pw)
            if need_b:
                gb, norms["bias"] = cast(pb.sum(0), b_dtype), kernels.row_sq(pb)
        sunk = deliver(ctx, norms, B)
        return cast(gx, x_dtype), gw, gb, None, None, None, sunk


def groupnorm_forward(module: nn.GroupNorm, slot):
    if not module.affine:
        return None
    params = module._parameters                # (a dict lookup, not nn.Module.__getattr__, per call)

    def forward(x):
        batched(module, x, 2)
        if x.shape[1] != module.num_channels:
            raise ValueError(f"GroupNorm expected {module.num_channels} channels, got input of shape "
                             f"{tuple(x.shape)}")
        slot.called()
        op = kernels.cxx_autograd("group_norm_norms", x)
        if op is not None:               # C++ autograd function: the backward fills the (weight, bias) rows
            buf, upcast = norm_layer_buffer(slot, x)
            out = op(x, params["weight"], params["bias"], module.num_groups, module.eps, buf, upcast)
            return as_autocast_gives(out, x)
        return as_autocast_gives(_GroupNormNorms.apply(x, module.weight, module.bias, module.num_groups,
                                                       module.eps, slot, sink_for(slot, x)), x)
    return forward


register_rule(nn.GroupNorm, groupnorm_norms, fused=groupnorm_forward)
