"""``nn.RMSNorm``: per-example gradients of its gain (Zhang & Sennrich 2019).

y = x·rstd·γ with rstd = (mean(x²) + ε)^(-1/2) over ``normalized_shape``; ∇γ ℓ_b = Σ_t δ_{b,t} ⊙ x̂_{b,t} with
x̂ = x·rstd, a (B, D) row per example: the LayerNorm kernel with a zero mean. As ATen does, the layer computes
in float32 for half-precision inputs (float64 for float64), ``eps=None`` is the machine epsilon of that
computation dtype, and the output has the input's dtype (autocast leaves ``rms_norm`` alone). Fused, the input
gradient is (g·γ − x̂·mean(x̂·g·γ))·rstd and the gain gradient the batch sum of the per-example rows.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import along_positions, batched, cast, normalized_dims, wider
from elasticlab.gns.registry import register_rule
from elasticlab.gns.sink import deliver, sink_for


def rms_eps(module: nn.RMSNorm, dtype: torch.dtype) -> float:
    """The ε ATen uses: the module's, else the machine epsilon of the computation dtype."""
    return module.eps if module.eps is not None else torch.finfo(kernels.acc_dtype(dtype)).eps


def rms_rstd(x3: torch.Tensor, eps: float) -> torch.Tensor:
    """(mean(x²) + ε)^(-1/2) over the last dimension of x3 (B, T, D): (B, T)."""
    return torch.rsqrt(x3.pow(2).mean(-1) + eps)


def rmsnorm_norms(module: nn.RMSNorm, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: ‖Σ_t δ_t ⊙ x̂_t‖² per example, in the computation dtype of the wider of x and δ."""
    if "weight" not in need:
        return {}
    x = inputs[0]
    D = math.prod(module.normalized_shape)
    batched(module, x, len(module.normalized_shape) + 1)
    dt = kernels.acc_dtype(wider(x, d))
    B = x.shape[0]
    x3, d3 = cast(x, dt).reshape(B, -1, D), cast(d, dt).reshape(B, -1, D)
    rstd = rms_rstd(x3, rms_eps(module, dt))
    gw, _ = kernels.layernorm_per_example(x3, d3, torch.zeros_like(rstd), rstd)
    return {"weight": kernels.row_sq(gw)}


class _RMSNormNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps, slot, sink=None):
        ctx.sink = None if sink is None else sink.dtype
        D = math.prod(normalized_shape)
        acc = kernels.acc_dtype(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            x3 = cast(x, acc).reshape(-1, D)
            rstd = torch.rsqrt(x3.pow(2).mean(-1, keepdim=True) + eps)
            out = x3 * rstd
            if weight is not None:
                out = out * weight.reshape(-1)
            out = out.to(x.dtype).view(x.shape)
        ctx.slot, ctx.shape = slot, normalized_shape
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        B, D = x.shape[0], math.prod(ctx.shape)
        acc = rstd.dtype
        x2, g2 = cast(x, acc).reshape(-1, D), cast(g, acc).reshape(-1, D)
        xhat = x2 * rstd
        gx = gw = None
        norms = {}
        if need_x:
            gxhat = g2 * cast(w, acc).reshape(-1) if w is not None else g2
            gx = ((gxhat - xhat * (xhat * gxhat).mean(-1, keepdim=True)) * rstd).to(x.dtype).view(x.shape)
        if need_w:
            pw = (g2 * xhat).view(B, -1, D).sum(1)
            gw, norms["weight"] = cast(pw.sum(0).view(ctx.shape), w.dtype), kernels.row_sq(pw)
        sunk = deliver(ctx, norms, B)
        return gx, gw, None, None, None, sunk


def rmsnorm_forward(module: nn.RMSNorm, slot):
    if module.weight is None:
        return None
    shape = list(module.normalized_shape)

    def forward(x):
        if x.dim() < len(shape) + 1:
            raise ValueError(f"per-example norms need a batch dimension first: RMSNorm got shape "
                             f"{tuple(x.shape)}")
        if list(x.shape[x.dim() - len(shape):]) != shape:
            raise ValueError(f"RMSNorm over {tuple(shape)} got an input of shape {tuple(x.shape)}")
        slot.called()
        return _RMSNormNorms.apply(x, module.weight, shape, rms_eps(module, x.dtype), slot, sink_for(slot, x))
    return forward


register_rule(nn.RMSNorm, rmsnorm_norms, params=("weight",), fused=rmsnorm_forward,
              summed=along_positions(rmsnorm_norms, normalized_dims, normalized_dims), folds=True)
