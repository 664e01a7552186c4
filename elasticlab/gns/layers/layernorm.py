"""``nn.LayerNorm``: per-example gradients of its affine parameters (Gray et al. 2024).

∇γ ℓ_b = Σ_t δ_{b,t} ⊙ x̂_{b,t} and ∇β ℓ_b = Σ_t δ_{b,t}, with x̂ = (x − μ)·rstd: (B, D) each, cheap to form,
so their norms are exact row norms. Fused, the parameter gradients are the batch sums of the same per-example
ones, and ATen's own backward gives the input gradient. Autocast runs LayerNorm in float32; so does the
rule. Fused calls go to the C++ autograd function ``elasticlab::layer_norm_norms``, or under
``torch.compile`` to
:class:`_LayerNormNorms`.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import (
    affine_norms,
    along_positions,
    as_autocast_gives,
    batched,
    cast,
    norm_layer_buffer,
    normalized_dims,
    wider,
)
from elasticlab.gns.registry import register_rule
from elasticlab.gns.sink import deliver, sink_for


def layernorm_stats(x3: torch.Tensor, eps: float):
    """(mean, rstd) over the last dimension."""
    var, mean = torch.var_mean(x3, dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def layernorm_norms(module: nn.LayerNorm, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: Σ_t d_t ⊙ x̂_t (weight) and Σ_t d_t (bias) per example."""
    x = inputs[0]
    D = math.prod(module.normalized_shape)
    batched(module, x, len(module.normalized_shape) + 1)
    dt = wider(x, d)
    B = x.shape[0]
    x3, d3 = cast(x, dt).reshape(B, -1, D), cast(d, dt).reshape(B, -1, D)
    mean, rstd = layernorm_stats(x3, module.eps)
    gw, gb = kernels.layernorm_per_example(x3, d3, mean, rstd)
    return affine_norms(gw, gb, need)


class _LayerNormNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, slot, sink=None):
        ctx.x_dtype = x.dtype
        ctx.sink = None if sink is None else sink.dtype
        if torch.is_autocast_enabled(x.device.type):          # autocast's layer_norm runs in float32
            x = cast(x, torch.promote_types(x.dtype, torch.float32))
            with torch.autocast(x.device.type, enabled=False):
                out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        else:
            out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.slot, ctx.shape = slot, normalized_shape
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w, b, mean, rstd = ctx.saved_tensors
        g = cast(g, x.dtype)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = None
        if need_x:
            gx = torch.ops.aten.native_layer_norm_backward(g, x, ctx.shape, mean, rstd, w, b,
                                                           [True, False, False])[0]
        B, D = x.shape[0], math.prod(ctx.shape)
        norms, gw, gb = {}, None, None
        if need_w or need_b:
            pw, pb = kernels.layernorm_per_example(x.reshape(B, -1, D), g.reshape(B, -1, D),
                                                   mean.reshape(B, -1), rstd.reshape(B, -1))
            if need_w:
                gw, norms["weight"] = cast(pw.sum(0).view(ctx.shape), w.dtype), kernels.row_sq(pw)
            if need_b:
                gb, norms["bias"] = cast(pb.sum(0).view(ctx.shape), b.dtype), kernels.row_sq(pb)
        sunk = deliver(ctx, norms, B)
        return cast(gx, ctx.x_dtype), gw, gb, None, None, None, sunk


def layernorm_forward(module: nn.LayerNorm, slot):
    shape = list(module.normalized_shape)
    params = module._parameters                # (a dict lookup, not nn.Module.__getattr__, per call)

    def forward(x):
        batched(module, x, len(shape) + 1)
        slot.called()
        op = kernels.cxx_autograd("layer_norm_norms", x)
        if op is not None:               # C++ autograd function: the backward fills the (weight, bias) rows
            buf, upcast = norm_layer_buffer(slot, x)
            return as_autocast_gives(op(x, params.get("weight"), params.get("bias"), shape, module.eps, buf,
                                        upcast), x)
        sink = sink_for(slot, x)
        return as_autocast_gives(_LayerNormNorms.apply(x, module.weight, module.bias, shape, module.eps, slot,
                                                       sink), x)
    return forward


register_rule(nn.LayerNorm, layernorm_norms, fused=layernorm_forward,
              summed=along_positions(layernorm_norms, normalized_dims, normalized_dims), folds=True)
