"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``: run step by step so that the gates' pre-activations are seen.

A recurrent layer applies two Linear maps at every step: W_ih to the input x_t (pre-activation i_t) and W_hh
to the previous hidden state h_{t−1} (pre-activation h̃_t). Per example, ∇W_ih ℓ_b = Σ_t δi_{b,t} x_{b,t}ᵀ and
∇W_hh ℓ_b = Σ_t δh̃_{b,t} h_{b,t−1}ᵀ: each a sequence Linear's gradient, whose norm is
:func:`~.linear.seq_weight_norms`' (Gram or outer form); the biases' are ‖Σ_t δ_{b,t}‖². cuDNN's and ATen's
fused kernels keep the pre-activations inside, so while norms are measured the layer runs as a loop over
time in PyTorch ops (as Opacus' DPLSTM does): the same function, slower. The input-side products of all
steps are one GEMM. Cells: Elman (tanh or relu), LSTM (gates i, f, g, o; Hochreiter & Schmidhuber 1997), GRU
(r, z, n; Cho et al. 2014, with PyTorch's r ⊙ (W_hn h + b_hn)). Multi-layer, bidirectional, dropout between
layers and ``batch_first`` are supported; packed sequences and LSTM projections (``proj_size``) are a clear
error.

Only δi is taken from the backward: the cell adds i_t and h̃_t (RNN, LSTM), so δh̃ = δi; a GRU adds them
but for its candidate gate, where δh̃_n = δi_n ⊙ r_t. One autograd node a layer and direction therefore
sees everything, with no hook per step: :class:`_Open` on the input-side pre-activations, whose backward
takes the norms, and :class:`_Close` on the direction's outputs, whose backward hands the forward's
hidden states (and a GRU's reset gates) back to it as the gradient of a *carrier* output of ``_Open``
(they are made after ``_Open`` ran). Under ``torch.compile`` the norms leave that backward through the sink
(:mod:`elasticlab.gns.sink`), with no graph break.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab.gns import kernels
from elasticlab.gns.layers.linear import seq_weight_norms
from elasticlab.gns.registry import register_rule
from elasticlab.gns.sink import deliver, sink_for

#: The parameters of a recurrent layer's direction and depth (``weight_ih_l0``, ...), and of a cell.
KINDS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def recurrent_params(module: nn.Module) -> tuple[str, ...]:
    """The parameters the rule covers, in the module's order: W_ih, W_hh (and b_ih, b_hh with ``bias``) of
    every layer and direction; not an LSTM's projection ``weight_hr`` (no rule)."""
    kinds = ("weight", "bias") if module.bias else ("weight",)
    sfxs = ("", "_reverse") if module.bidirectional else ("",)
    return tuple(f"{kind}_{side}_l{k}{sfx}" for k in range(module.num_layers) for sfx in sfxs
                 for kind in kinds for side in ("ih", "hh"))


def _cell(module: nn.Module, gi, gh, state):
    """One step from the pre-activations: (new state, output h, a GRU's reset gate r or None)."""
    if isinstance(module, nn.LSTM):
        i, f, g, o = (gi + gh).chunk(4, 1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h, c), h, None
    if isinstance(module, nn.GRU):
        ir, iz, i_n = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        h = (1 - z) * torch.tanh(i_n + r * hn) + z * state
        return h, h, r
    h = torch.tanh(gi + gh) if module.nonlinearity == "tanh" else torch.relu(gi + gh)
    return h, h, None


def recurrent_check(module: nn.Module) -> None:
    if getattr(module, "proj_size", 0):
        raise ValueError("per-example norms of nn.LSTM with proj_size > 0 are not supported (its weight_hr "
                         "has no rule); use proj_size=0 or freeze the LSTM")


def direction_norms(module: nn.Module, sfx: str, x: torch.Tensor, carry: torch.Tensor, g: torch.Tensor,
                    need) -> dict:
    """The four norms of one layer and direction from δi (B, T, G) ``g``, its input x (B, T, F) and
    ``carry`` (B, T, H): the hidden state each step took (a GRU's reset gates after them), in time order."""
    H = module.hidden_size
    hs = carry[..., :H].to(g.dtype)
    dh = torch.cat((g[..., :2 * H], g[..., 2 * H:] * carry[..., H:].to(g.dtype)), 2) \
        if isinstance(module, nn.GRU) else g
    names = [f"{k}_{sfx}" for k in KINDS]
    out = {}
    if names[0] in need:
        out[names[0]] = seq_weight_norms(x.to(g.dtype), g)
    if names[1] in need:
        out[names[1]] = seq_weight_norms(hs, dh)
    acc = kernels.acc_dtype(g.dtype)
    if names[2] in need or (names[3] in need and dh is g):
        out[names[2]] = kernels.row_sq(g.sum(1, dtype=acc))
    if names[3] in need:
        out[names[3]] = out[names[2]] if dh is g else kernels.row_sq(dh.sum(1, dtype=acc))
    return out


class _Open(torch.autograd.Function):
    """Identity on the input-side pre-activations δi flows through, and a (B, T, C) *carrier* (zero,
    expanded from a scalar) that :class:`_Close` hands the hidden states back through. The backward takes
    the norms (:func:`direction_norms`) and delivers them (recorded, or the sink's gradient when compiled)."""

    @staticmethod
    def forward(ctx, gi, sink, slot, module, sfx, x, channels):
        ctx.slot, ctx.module, ctx.sfx, ctx.sink = slot, module, sfx, None if sink is None else sink.dtype
        ctx.save_for_backward(x)
        carrier = gi.new_zeros((), dtype=kernels.acc_dtype(gi.dtype)).expand(*gi.shape[:2], channels)
        return gi.view_as(gi), carrier

    @staticmethod
    @once_differentiable
    def backward(ctx, g, carry):
        x, = ctx.saved_tensors
        norms = direction_norms(ctx.module, ctx.sfx, x, carry, g, ctx.slot.need)
        return g, deliver(ctx, norms, g.shape[0]), None, None, None, None, None


class _Close(torch.autograd.Function):
    """Identity on a direction's outputs; its backward returns ``carry`` (the forward's hidden states,
    detached) as the carrier's gradient."""

    @staticmethod
    def forward(ctx, carrier, carry, *outs):
        ctx.save_for_backward(carry)
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        carry, = ctx.saved_tensors
        return (carry, None, *grads)


def _direction(module, slot, x, state, layer: int, reverse: bool):
    """One layer in one direction over x (B, T, F): (outputs (B, T, H), final state), between an
    :class:`_Open` and a :class:`_Close` when one of its parameters trains."""
    sfx = f"l{layer}" + ("_reverse" if reverse else "")
    p = module._parameters
    w_ih, w_hh, b_ih, b_hh = (p.get(f"{k}_{sfx}") for k in KINDS)
    gi = F.linear(x, w_ih, b_ih)                                  # (B, T, G): all steps in one GEMM
    is_gru = isinstance(module, nn.GRU)
    tracked = torch.is_grad_enabled() and any(f"{k}_{sfx}" in slot.need for k in KINDS)
    if tracked:
        sink = sink_for(slot, x)
        if sink is None and not gi.requires_grad:
            gi = gi.detach().requires_grad_()    # W_ih frozen, input without gradient: δi still gives W_hh's
        gi, carrier = _Open.apply(gi, sink, slot, module, sfx, x.detach(),
                                  module.hidden_size * (2 if is_gru else 1))
    steps = gi.unbind(1)
    T = len(steps)
    prev, gates, outs = [None] * T, [None] * T, [None] * T
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        h_prev = state[0] if isinstance(state, tuple) else state
        prev[t] = h_prev.detach()
        gh = F.linear(h_prev, w_hh, b_hh)
        state, outs[t], r = _cell(module, steps[t], gh, state)
        if is_gru:
            gates[t] = r.detach()
    out = torch.stack(outs, 1)
    if not tracked:
        return out, state
    carry = torch.stack(prev, 1)
    if is_gru:
        carry = torch.cat((carry, torch.stack(gates, 1)), 2)
    carry = carry.to(kernels.acc_dtype(gi.dtype))                  # the carrier's dtype (no copy if it is)
    if isinstance(state, tuple):
        out, h, c = _Close.apply(carrier, carry, out, *state)
        return out, (h, c)
    out, state = _Close.apply(carrier, carry, out, state)
    return out, state


def recurrent_forward(module: nn.Module, slot):
    """The layer as a loop over time, each layer and direction between an _Open and a _Close (same arguments
    and results as its own)."""
    is_lstm = isinstance(module, nn.LSTM)

    def forward(input, hx=None):
        slot.called()
        if isinstance(input, nn.utils.rnn.PackedSequence):
            raise ValueError(f"per-example norms of {type(module).__name__} do not support PackedSequence "
                             "inputs: pad the batch (and mask the loss) instead")
        if input.dim() != 3:
            raise ValueError(f"per-example norms need a batch dimension: {type(module).__name__} got an "
                             f"input of shape {tuple(input.shape)}")
        x = input if module.batch_first else input.transpose(0, 1)           # (B, T, F)
        B, dirs, H = x.shape[0], 2 if module.bidirectional else 1, module.hidden_size
        if hx is None:
            zeros = x.new_zeros(module.num_layers * dirs, B, H)
            hx = (zeros, zeros) if is_lstm else zeros
        finals_h, finals_c = [], []
        for layer in range(module.num_layers):
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                state = (hx[0][k], hx[1][k]) if is_lstm else hx[k]
                out, state = _direction(module, slot, x, state, layer, reverse=d == 1)
                outs.append(out)
                finals_h.append(state[0] if is_lstm else state)
                if is_lstm:
                    finals_c.append(state[1])
            x = outs[0] if dirs == 1 else torch.cat(outs, 2)
            if module.dropout and module.training and layer < module.num_layers - 1:
                x = F.dropout(x, module.dropout, True)
        output = x if module.batch_first else x.transpose(0, 1)
        h_n = torch.stack(finals_h)
        return output, ((h_n, torch.stack(finals_c)) if is_lstm else h_n)
    return forward


for _cls in (nn.RNN, nn.LSTM, nn.GRU):
    register_rule(_cls, None, params=recurrent_params, fused=recurrent_forward, check=recurrent_check)
