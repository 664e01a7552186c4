"""``nn.Conv1d`` / ``nn.Conv2d``: a Linear over the L output positions of the unfolded input, per group.

Hook rule and fused backward. Fused, the weight norms come either from the Gram form over the unfolded input
(while ATen's own backward forms the weight gradient), or from per-example weight gradients whose batch sum is
the weight gradient: on CUDA one batched GEMM per chunk of examples over the unfolded input (the same
outer-product operator as a sequence Linear), on the CPU as the weight gradient of one convolution with
c·groups groups (the batch folded into channels; Goodfellow 2015's trick), measured faster there. The choice
is per layer, by :func:`elasticlab.gns.kernels.use_gram`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import autocast_dtype, batched, cast
from elasticlab.gns.layers.linear import seq_weight_norms
from elasticlab.gns.registry import register_rule

# Unfolded-input elements per chunk of a Conv's backward: bounds its scratch memory (4 MB on the CPU;
# 256 MB of float32 on CUDA, where fewer, larger launches matter more).
CONV_CHUNK_ELEMS = {"cpu": 1 << 20, "cuda": 1 << 26}


def _chunk_elems(x: torch.Tensor) -> int:
    return CONV_CHUNK_ELEMS.get(x.device.type, CONV_CHUNK_ELEMS["cpu"])


def conv_unfold(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """im2col of a Conv1d/Conv2d input: (B, Cin·k, L), padding modes and string paddings included."""
    nd = 1 if isinstance(module, nn.Conv1d) else 2
    padding = module.padding
    if module.padding_mode != "zeros" or isinstance(padding, str):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * nd
    if nd == 1:
        x = x.unsqueeze(2)
        k, s, p, dil = (1, *module.kernel_size), (1, *module.stride), (0, *padding), (1, *module.dilation)
    else:
        k, s, p, dil = module.kernel_size, module.stride, padding, module.dilation
    return F.unfold(x, k, dilation=dil, padding=p, stride=s)


def conv_norms(module: nn.Module, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: Conv1d/Conv2d as a Linear over the L output positions of the unfolded input, per group."""
    x = inputs[0]
    nd = 1 if isinstance(module, nn.Conv1d) else 2
    batched(module, x, nd + 2)
    x = cast(x, d.dtype)
    B, G = x.shape[0], module.groups
    out = {}
    d3 = d.reshape(B, d.shape[1], -1)                          # (B, Cout, L)
    if "weight" in need:
        U = conv_unfold(module, x)                               # (B, Cin·k, L)
        K, L, cog = U.shape[1] // G, U.shape[2], d3.shape[1] // G
        a = U.view(B * G, K, L).transpose(1, 2)                  # (B·G, L, K)
        dd = d3.reshape(B * G, cog, L).transpose(1, 2)           # (B·G, L, Cout/G)
        out["weight"] = seq_weight_norms(a, dd).view(B, G).sum(1)
    if "bias" in need:
        out["bias"] = kernels.row_sq(d3.sum(2, dtype=torch.float32 if d3.dtype.itemsize < 4 else None))
    return out


class _ConvNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, slot, dtype):
        ctx.slot, ctx.module = slot, module
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        xc, wc, bc = cast(x, dtype), cast(weight, dtype), cast(bias, dtype)
        ctx.save_for_backward(xc, wc)
        conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d
        with torch.autocast(x.device.type, enabled=False):
            return conv(xc, wc, bc, module.stride, module.padding, module.dilation, module.groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        m = ctx.module
        g = cast(g, x.dtype)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        B, G = x.shape[0], m.groups
        cout = w.shape[0]
        d3 = g.reshape(B, cout, -1)
        L = d3.shape[2]
        K = w[0].numel()                                    # Cin/G · k
        gram = need_w and kernels.use_gram(L, K, cout // G, fused_outer=True, like=x, batch=B * G,
                                           row_major=False)
        gx, gw_native, _ = torch.ops.aten.convolution_backward(
            g, x, w, None, list(m.stride), list(m.padding), list(m.dilation), False,
            [0] * len(m.stride), G, [need_x, bool(gram), False])
        norms = {}
        gw = gw_native
        if need_w:
            if gram:
                norms["weight"] = _conv_gram_norms(m, x, d3, G, K, L)
            elif x.device.type == "cuda":
                norms["weight"], gw = _conv_outer_unfolded(m, x, d3, w)
            else:
                norms["weight"], gw = _conv_per_example(m, x, g, w)
        gb = None
        if need_b:
            db = d3.sum(2, dtype=torch.float32 if d3.dtype.itemsize < 4 else None)
            gb = db.sum(0)
            norms["bias"] = kernels.row_sq(db)
        ctx.slot.record(norms, B)
        return cast(gx, x_dtype), cast(gw, w_dtype), cast(gb, b_dtype), None, None, None


def _conv_gram_norms(m, x, d3, G, K, L):
    """Gram form over the L output positions of the unfolded input, chunk by chunk."""
    B, cout = x.shape[0], d3.shape[1]
    per = torch.empty(B, device=x.device, dtype=torch.float32 if x.dtype.itemsize < 4 else x.dtype)
    step = max(1, _chunk_elems(x) // (K * G * L))
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        U = conv_unfold(m, x[b0:b1]).view(b1 - b0, G, K, L)
        dg = d3[b0:b1].view(b1 - b0, G, cout // G, L)
        per[b0:b1] = sum(kernels.seq_linear_gram_norms(U[:, gi].transpose(1, 2), dg[:, gi].transpose(1, 2))
                         for gi in range(G))
    return per


def _conv_outer_unfolded(m, x, d3, w):
    """Per-example weight gradients as one batched GEMM per chunk over the unfolded input (CUDA): the
    outer-product operator on (L, K) and (L, Cout/G) views, its Σ_b G_b the weight gradient."""
    B, G, cout = x.shape[0], m.groups, w.shape[0]
    K, L, cog = w[0].numel(), d3.shape[2], cout // G
    per = torch.zeros(B, device=x.device, dtype=torch.float32 if x.dtype.itemsize < 4 else x.dtype)
    gw = torch.zeros(G, cog, K, device=x.device, dtype=per.dtype)
    step = max(1, _chunk_elems(x) // (K * G * L))
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        U = conv_unfold(m, x[b0:b1]).view(b1 - b0, G, K, L)
        dg = d3[b0:b1].view(b1 - b0, G, cog, L)
        for gi in range(G):
            n, s = kernels.seq_linear_outer_norms(U[:, gi].transpose(1, 2), dg[:, gi].transpose(1, 2),
                                                  with_grad=True)
            per[b0:b1] += n
            gw[gi] += s
    return per, gw.view_as(w)


def _conv_per_example(m, x, g, w):
    """Per-example weight gradients of c examples at once as the weight gradient of one convolution with
    c·groups groups (CPU), chunk by chunk; returns (‖G_b‖² (B,), Σ_b G_b)."""
    B, G, cout = x.shape[0], m.groups, w.shape[0]
    acc = torch.float32 if x.dtype.itemsize < 4 else x.dtype
    per, gw = torch.empty(B, dtype=acc), torch.zeros(w.shape, dtype=acc)
    step = max(1, min(32, _chunk_elems(x) // w.numel()))
    nd = x.dim() - 2
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        c = b1 - b0
        xg = x[b0:b1].reshape(1, c * x.shape[1], *x.shape[2:])
        gg = g[b0:b1].reshape(1, c * cout, *g.shape[2:])
        wg = w.unsqueeze(0).expand(c, *w.shape).reshape(c * cout, *w.shape[1:])
        pe = torch.ops.aten.convolution_backward(
            gg, xg, wg, None, list(m.stride), list(m.padding), list(m.dilation), False, [0] * nd, c * G,
            [False, True, False])[1].view(c, *w.shape)
        per[b0:b1] = kernels.row_sq(pe)
        gw += pe.sum(0)
    return per, gw


def conv_forward(module: nn.Module, slot):
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return None                                         # the hook form handles these
    nd = 1 if isinstance(module, nn.Conv1d) else 2

    def forward(x):
        if x.dim() != nd + 2:
            raise ValueError(f"per-example norms need a batch dimension first: {type(module).__name__} got "
                             f"shape {tuple(x.shape)}")
        slot.called()
        return _ConvNorms.apply(x, module.weight, module.bias, module, slot, autocast_dtype(x))
    return forward


register_rule(nn.Conv1d, conv_norms, fused=conv_forward)
register_rule(nn.Conv2d, conv_norms, fused=conv_forward)
