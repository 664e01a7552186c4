"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``: run step by step so that the gates' pre-activations are seen.

A recurrent layer applies two Linear maps at every step: W_ih to the input x_t (pre-activation i_t) and W_hh
to the previous hidden state h_{t−1} (pre-activation h̃_t). Per example, ∇W_ih ℓ_b = Σ_t δi_{b,t} x_{b,t}ᵀ and
∇W_hh ℓ_b = Σ_t δh̃_{b,t} h_{b,t−1}ᵀ: each a sequence Linear's gradient, whose norm is
:func:`~.linear.seq_weight_norms`' (Gram or outer form); the biases' are ‖Σ_t δ_{b,t}‖². cuDNN's and ATen's
fused kernels keep the pre-activations inside, so while norms are measured the layer runs as a loop over
time in PyTorch ops (as Opacus' DPLSTM does): the same function, slower. The input-side products of all
steps are one GEMM, split with ``unbind`` so that their gradients come back stacked. Cells: Elman (tanh or
relu), LSTM (gates i, f, g, o; Hochreiter & Schmidhuber 1997), GRU (r, z, n; Cho et al. 2014, with PyTorch's
r ⊙ (W_hn h + b_hn)). Multi-layer, bidirectional, dropout between layers and ``batch_first`` are
supported; packed sequences and LSTM projections (``proj_size``) are a clear error.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.linear import seq_weight_norms
from elasticlab.gns.registry import register_rule


def recurrent_params(module: nn.Module) -> tuple[str, ...]:
    """The parameters the rule covers, in the module's order: W_ih, W_hh (and b_ih, b_hh with ``bias``) of
    every layer and direction; not an LSTM's projection ``weight_hr`` (no rule)."""
    kinds = ("weight", "bias") if module.bias else ("weight",)
    sfxs = ("", "_reverse") if module.bidirectional else ("",)
    return tuple(f"{kind}_{side}_l{k}{sfx}" for k in range(module.num_layers) for sfx in sfxs
                 for kind in kinds for side in ("ih", "hh"))


def _cell(module: nn.Module, gi, gh, state):
    """One step from the pre-activations: (new state, output h)."""
    if isinstance(module, nn.LSTM):
        i, f, g, o = (gi + gh).chunk(4, 1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h, c), h
    if isinstance(module, nn.GRU):
        ir, iz, i_n = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        h = (1 - z) * torch.tanh(i_n + r * hn) + z * state
        return h, h
    h = torch.tanh(gi + gh) if module.nonlinearity == "tanh" else torch.relu(gi + gh)
    return h, h


def recurrent_check(module: nn.Module) -> None:
    if getattr(module, "proj_size", 0):
        raise ValueError("per-example norms of nn.LSTM with proj_size > 0 are not supported (its weight_hr "
                         "has no rule); use proj_size=0 or freeze the LSTM")


def _direction(module, slot, x, state, layer: int, reverse: bool):
    """One layer in one direction over x (B, T, F): (outputs (B, T, H), final state). Hooks the gradients
    of its pre-activations and records the four parameters' norms when the input side's arrives."""
    sfx = f"l{layer}" + ("_reverse" if reverse else "")
    p = module._parameters
    w_ih, w_hh, b_ih, b_hh = (p.get(f"{k}_{sfx}") for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    gi = F.linear(x, w_ih, b_ih)                                  # (B, T, G): all steps in one GEMM
    steps = gi.unbind(1)
    T = len(steps)
    order = range(T - 1, -1, -1) if reverse else range(T)
    prev, dgh, outs = [], [None] * T, [None] * T
    for k, t in enumerate(order):
        h_prev = state[0] if isinstance(state, tuple) else state
        prev.append(h_prev.detach())
        gh = F.linear(h_prev, w_hh, b_hh)
        if gh.requires_grad:
            gh.register_hook(lambda g, k=k: dgh.__setitem__(k, g.detach()))
        state, outs[t] = _cell(module, steps[t], gh, state)
    if gi.requires_grad:
        xs, hs = x.detach(), torch.stack(prev, 1)

        def on_grad(g):
            acc = kernels.acc_dtype(g.dtype)
            # hs and dh are both in processing order (reversed for the reverse direction): the sums over
            # steps pair them alike. A step no gradient reached contributes nothing.
            dh = torch.stack([d if d is not None else torch.zeros_like(g[:, 0]) for d in dgh], 1)
            norms = {f"weight_ih_{sfx}": seq_weight_norms(xs.to(g.dtype), g),
                     f"weight_hh_{sfx}": seq_weight_norms(hs.to(dh.dtype), dh),
                     f"bias_ih_{sfx}": kernels.row_sq(g.sum(1, dtype=acc)),
                     f"bias_hh_{sfx}": kernels.row_sq(dh.sum(1, dtype=acc))}
            slot.record(norms, g.shape[0])
        gi.register_hook(on_grad)
    return torch.stack(outs, 1), state


def recurrent_forward(module: nn.Module, slot):
    """The layer as a loop over time with its gradients hooked (same arguments and results as its own)."""
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
