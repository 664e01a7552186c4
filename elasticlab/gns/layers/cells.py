"""``nn.RNNCell`` / ``nn.LSTMCell`` / ``nn.GRUCell``: one step of a recurrent cell, usually called once per
time step in a hand-written loop (a seq2seq decoder, a recurrent policy).

Every cell starts with two affine maps, g_i = W_ih x + b_ih and g_h = W_hh h + b_hh, and its parameters enter
nowhere else, so with δ_i, δ_h the gradients of g_i and g_h the per-example gradients are δ_i x_bᵀ, δ_i, δ_h
h_bᵀ and δ_h; for one call their squared norms are ‖x_b‖²‖δ_i‖², ‖δ_i‖², ‖h_b‖²‖δ_h‖² and ‖δ_h‖² (Goodfellow
2015). The fused forward forms g_i and g_h in one autograd function whose backward receives δ_i and δ_h, and
runs the cell's gates in plain torch (LSTM: i, f, g, o; GRU: r, z, n, with r applied to g_h's n part, as
PyTorch defines it). A cell called at each of T steps is a repeated module (:mod:`elasticlab.gns.repeated`):
each call's (x, h, δ_i, δ_h) is kept, and the norms are those of the Linear over the T positions, ‖Σ_t δ_{i,t}
x_tᵀ‖² by the Gram or outer-product form — exact, from the first step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import autocast_dtype, batched, cast
from elasticlab.gns.layers.linear import summed_parts
from elasticlab.gns.layers.recurrent import KINDS
from elasticlab.gns.registry import register_rule
from elasticlab.gns.sink import deliver, sink_for


class _Gates(torch.autograd.Function):
    """(g_i, g_h) = (x W_ihᵀ + b_ih, h W_hhᵀ + b_hh); backward: the input and parameter gradients and the
    per-example norms (or, for a repeated cell, this call's x, h, δ_i, δ_h kept in its slot)."""

    @staticmethod
    def forward(ctx, x, h, w_ih, w_hh, b_ih, b_hh, slot, dtype, sink=None):
        ctx.slot, ctx.sink = slot, None if sink is None else sink.dtype
        ctx.dtypes = (x.dtype, h.dtype, w_ih.dtype, w_hh.dtype)
        xc, hc, wi, wh = cast(x, dtype), cast(h, dtype), cast(w_ih, dtype), cast(w_hh, dtype)
        with torch.autocast(x.device.type, enabled=False):
            gi = F.linear(xc, wi, cast(b_ih, dtype))
            gh = F.linear(hc, wh, cast(b_hh, dtype))
        ctx.save_for_backward(xc, hc, wi, wh)
        return gi, gh

    @staticmethod
    @once_differentiable
    def backward(ctx, di, dh):
        x, h, wi, wh = ctx.saved_tensors
        need = ctx.needs_input_grad
        di = x.new_zeros(x.shape[0], wi.shape[0]) if di is None else di.to(x.dtype)
        dh = x.new_zeros(x.shape[0], wh.shape[0]) if dh is None else dh.to(x.dtype)
        gx = (di @ wi).to(ctx.dtypes[0]) if need[0] else None
        gh = (dh @ wh).to(ctx.dtypes[1]) if need[1] else None
        gwi = (di.t() @ x).to(ctx.dtypes[2]) if need[2] else None
        gwh = (dh.t() @ h).to(ctx.dtypes[3]) if need[3] else None
        acc = kernels.acc_dtype(di.dtype)
        gbi = di.sum(0, dtype=acc) if need[4] else None
        gbh = dh.sum(0, dtype=acc) if need[5] else None
        slot = ctx.slot
        if slot.shared and ctx.sink is None:                  # repeated: the Linear parts, summed when read
            parts = [("seq", "weight_ih", 0, x[:, None], di[:, None]), ("rows", "bias_ih", 0, di),
                     ("seq", "weight_hh", 0, h[:, None], dh[:, None]), ("rows", "bias_hh", 0, dh)]
            slot.pending.append((parts, x.shape[0]))
            sunk = None
        else:
            di_sq, dh_sq = kernels.row_sq(di), kernels.row_sq(dh)
            norms = {"weight_ih": kernels.row_sq(x) * di_sq, "bias_ih": di_sq,
                     "weight_hh": kernels.row_sq(h) * dh_sq, "bias_hh": dh_sq}
            sunk = deliver(ctx, {k: v for k, v in norms.items() if k in slot.need}, x.shape[0])
        return gx, gh, gwi, gwh, gbi, gbh, None, None, sunk


def _gates(module: nn.Module, x: torch.Tensor, h: torch.Tensor, slot):
    dtype = autocast_dtype(x) or torch.promote_types(x.dtype, h.dtype)
    return _Gates.apply(x, h, module.weight_ih, module.weight_hh, module.bias_ih, module.bias_hh, slot, dtype,
                        sink_for(slot, x))


def cell_step(module: nn.Module, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor, c=None):
    """The cell's output from its two affine maps (PyTorch's definitions of the three cells)."""
    if isinstance(module, nn.LSTMCell):
        i, f, g, o = (gi + gh).chunk(4, 1)
        c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c2), c2
    if isinstance(module, nn.GRUCell):
        ri, zi, ni = gi.chunk(3, 1)
        rh, zh, nh = gh.chunk(3, 1)
        r, z = torch.sigmoid(ri + rh), torch.sigmoid(zi + zh)
        n = torch.tanh(ni + r * nh)
        return (1 - z) * n + z * h
    return torch.tanh(gi + gh) if module.nonlinearity == "tanh" else torch.relu(gi + gh)


def cell_forward(module: nn.Module, slot):
    """The fused forward: the two affine maps through :class:`_Gates`, then the gates."""
    def forward(x, hx=None):
        batched(module, x, 2)
        if not torch.is_grad_enabled():
            return type(module).forward(module, x, hx)
        slot.called()          # (a recomputation, not counted, saves what the forward saved: same path)
        lstm = isinstance(module, nn.LSTMCell)
        if hx is None:
            z = x.new_zeros(x.shape[0], module.hidden_size)
            hx = (z, z) if lstm else z
        h, c = hx if lstm else (hx, None)
        gi, gh = _gates(module, x, h, slot)
        return cell_step(module, gi, gh, h, c)
    return forward


for _cls in (nn.RNNCell, nn.LSTMCell, nn.GRUCell):
    register_rule(_cls, None, params=KINDS, fused=cell_forward, summed=summed_parts)
