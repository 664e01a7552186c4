"""Fused forms: replacement forwards whose backward forms parameter gradients and per-example norms together.

A sequence Linear forms its weight gradient Σ_b G_b from the per-example G_b = d_bᵀ a_b, so the norms
‖G_b‖² cost a reduction instead of a second GEMM (the "book-keeping" idea of Bu et al. 2023; nanoGNS forms
G_b the same way). A Conv forms its per-example weight gradients with one grouped convolution per chunk of
the batch. LayerNorm's parameter gradients are the batch sums of its per-example ones (Gray et al. 2024).
Input gradients come from ATen's own backward. Each backward hands {param: (B,) norms} of the loss as
reduced to ``slot.record``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab.gns import kernels
from elasticlab.gns.rules import conv_unfold, row_sq

# Unfolded-input elements per chunk of a Conv's backward (bounds its scratch memory to a few MB).
CONV_CHUNK_ELEMS = 1 << 20


class _LinearNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, slot):
        ctx.slot = slot
        # ‖a_b‖² of 2-D inputs now, while x is still in cache from the layer that made it.
        ctx.x_sq = row_sq(x) if x.dim() == 2 and ctx.needs_input_grad[1] else None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = g.matmul(w) if need_x else None
        gw = gb = None
        norms = {}
        B = x.shape[0]
        if x.dim() == 2:
            g_sq = row_sq(g) if (need_w or need_b) else None
            if need_w:
                gw = g.t().mm(x)
                norms["weight"] = (ctx.x_sq if ctx.x_sq is not None else row_sq(x)) * g_sq
            if need_b:
                gb = g.sum(0)
                norms["bias"] = g_sq
        else:
            a, d = x.reshape(B, -1, x.shape[-1]), g.reshape(B, -1, g.shape[-1])
            if need_w:
                if kernels.use_gram(a.shape[1], a.shape[2], d.shape[2], fused_outer=True):
                    norms["weight"] = kernels.seq_linear_gram_norms(a, d)
                    gw = d.reshape(-1, d.shape[2]).t().mm(a.reshape(-1, a.shape[2]))
                else:
                    norms["weight"], gw = kernels.seq_linear_outer_norms(a, d, with_grad=True)
            if need_b:
                db = d.sum(1)
                gb = db.sum(0)
                norms["bias"] = row_sq(db)
        ctx.slot.record(norms, B)
        return gx, gw, gb, None


def linear_forward(module: nn.Linear, slot):
    def forward(x):
        if x.dim() < 2:
            raise ValueError("per-example norms need a batch dimension first: Linear got shape "
                             f"{tuple(x.shape)}")
        slot.called()
        return _LinearNorms.apply(x, module.weight, module.bias, slot)
    return forward


class _ConvNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, slot):
        ctx.slot, ctx.module = slot, module
        ctx.save_for_backward(x, weight)
        conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d
        return conv(x, weight, bias, module.stride, module.padding, module.dilation, module.groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        m = ctx.module
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        B, G = x.shape[0], m.groups
        cout = w.shape[0]
        d3 = g.reshape(B, cout, -1)
        L = d3.shape[2]
        K = w[0].numel()                                    # Cin/G · k
        gram = need_w and kernels.use_gram(L, K, cout // G)    # the grouped path costs ~half a wgrad
        gx, gw_native, _ = torch.ops.aten.convolution_backward(
            g, x, w, None, list(m.stride), list(m.padding), list(m.dilation), False,
            [0] * len(m.stride), G, [need_x, bool(gram), False])
        norms = {}
        gw = gw_native
        if need_w:
            if gram:
                norms["weight"] = _conv_gram_norms(m, x, d3, G, K, L)
            else:
                norms["weight"], gw = _conv_per_example(m, x, g, w)
        gb = None
        if need_b:
            db = d3.sum(2)
            gb = db.sum(0)
            norms["bias"] = row_sq(db)
        ctx.slot.record(norms, B)
        return gx, gw, gb, None, None


def _conv_gram_norms(m, x, d3, G, K, L):
    """Gram form over the L output positions of the unfolded input, chunk by chunk."""
    B, cout = x.shape[0], d3.shape[1]
    per = x.new_empty(B)
    step = max(1, CONV_CHUNK_ELEMS // (K * G * L))
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        U = conv_unfold(m, x[b0:b1]).view(b1 - b0, G, K, L)
        dg = d3[b0:b1].view(b1 - b0, G, cout // G, L)
        per[b0:b1] = sum(kernels.seq_linear_gram_norms(U[:, gi].transpose(1, 2), dg[:, gi].transpose(1, 2))
                         for gi in range(G))
    return per


def _conv_per_example(m, x, g, w):
    """Per-example weight gradients of c examples at once as the weight gradient of one convolution with
    c·groups groups (the batch folded into channels; Goodfellow 2015's trick, as in Opacus' functorch path),
    chunk by chunk; returns (‖G_b‖² (B,), Σ_b G_b). Measured faster than im2col + per-example GEMMs on CPU."""
    B, G, cout = x.shape[0], m.groups, w.shape[0]
    per, gw = x.new_empty(B), torch.zeros_like(w)
    step = max(1, min(32, CONV_CHUNK_ELEMS // w.numel()))
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
        per[b0:b1] = row_sq(pe)
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
        return _ConvNorms.apply(x, module.weight, module.bias, module, slot)
    return forward


class _LayerNormNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, slot):
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.slot, ctx.shape = slot, normalized_shape
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w, b, mean, rstd = ctx.saved_tensors
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
                gw, norms["weight"] = pw.sum(0).view(ctx.shape), row_sq(pw)
            if need_b:
                gb, norms["bias"] = pb.sum(0).view(ctx.shape), row_sq(pb)
        ctx.slot.record(norms, B)
        return gx, gw, gb, None, None, None


def layernorm_forward(module: nn.LayerNorm, slot):
    shape = list(module.normalized_shape)

    def forward(x):
        if x.dim() < len(shape) + 1:
            raise ValueError(f"per-example norms need a batch dimension first: LayerNorm got shape "
                             f"{tuple(x.shape)}")
        slot.called()
        return _LayerNormNorms.apply(x, module.weight, module.bias, shape, module.eps, slot)
    return forward
