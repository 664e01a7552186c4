"""``nn.EmbeddingBag``: each bag is one example; its gradient is its output gradient on a few table rows.

Bag b's output is o_b = Σ_j c_j E[idx_j] over its positions j (``sum``: c_j = 1, or the per-sample weight;
``mean``: c_j = 1/n_b over its n_b non-padding positions), so ∇E ℓ_b puts (Σ_{j: idx_j=v} c_j)·δ_b on row
v, and ‖∇E ℓ_b‖² = ‖δ_b‖² · Σ_v (Σ_{j: idx_j=v} c_j)². Under ``max`` each output coordinate takes one row,
so ‖∇E ℓ_b‖² = ‖δ_b‖² for a non-empty bag. The coefficient sums over (bag, index) keys are
:func:`.embedding.segment_sums`' (a sort), with nothing waiting on the host. The batch is the bags: the rows
of a 2-D input, or the bags its ``offsets`` cut a 1-D input into. A replacement forward (it sees
``offsets`` and ``per_sample_weights`` passed by keyword, which a forward hook does not) runs the module's
own forward and hooks its output's gradient.
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.embedding import segment_sums
from elasticlab.gns.registry import register_rule
from elasticlab.gns.sink import tap


def bag_coefficient_sq(module: nn.EmbeddingBag, idx: torch.Tensor, offsets, per_sample_weights,
                       bags: int, dtype: torch.dtype) -> torch.Tensor:
    """(bags,) Σ_v (Σ_{j in bag b, idx_j = v} c_j)² (``sum``/``mean``), or 1 for a non-empty bag (``max``)."""
    dev = idx.device
    if idx.dim() == 2:
        bag = torch.arange(idx.shape[0], device=dev).repeat_interleave(idx.shape[1])
        idx = idx.reshape(-1)
    else:
        starts = offsets[:-1] if module.include_last_offset else offsets
        bag = torch.searchsorted(starts, torch.arange(idx.numel(), device=dev), right=True) - 1
    pad = module.padding_idx
    keep = torch.ones_like(idx, dtype=dtype) if pad is None else (idx != pad).to(dtype)
    count = keep.new_zeros(bags).index_add_(0, bag.clamp(0, bags - 1), keep)
    if module.mode == "max":
        return (count > 0).to(dtype)
    c = keep if per_sample_weights is None else keep * per_sample_weights.reshape(-1).to(dtype)
    if module.mode == "mean":
        c = c / count.clamp_min(1)[bag]
    sums, owner = segment_sums(bag, idx, module.num_embeddings, c)
    return c.new_zeros(bags).index_add_(0, owner.clamp(0, bags - 1), sums * sums)


def embedding_bag_forward(module: nn.EmbeddingBag, slot):
    """The module's own forward, its output's gradient hooked: ‖δ_b‖² times :func:`bag_coefficient_sq`."""
    own = type(module).forward

    def forward(input, offsets=None, per_sample_weights=None):
        slot.called()
        out = own(module, input, offsets, per_sample_weights)
        if out.requires_grad and module.weight.requires_grad:
            inputs = (input, offsets, per_sample_weights)
            # compiled: the norms leave the backward as a gradient (elasticlab.gns.sink)
            if torch.compiler.is_compiling() and (t := tap(slot, module, inputs, out, bag_norms)) is not None:
                return t
            saved, bags = tuple(None if v is None else v.detach() for v in inputs), out.shape[0]
            out.register_hook(lambda g: slot.record(bag_norms(module, saved, g.detach(), slot.need), bags))
        return out
    return forward


def bag_norms(module: nn.EmbeddingBag, inputs, g: torch.Tensor, need) -> dict:
    """{"weight": ‖δ_b‖² times :func:`bag_coefficient_sq`} from the inputs (input, offsets,
    per_sample_weights) and the output's gradient δ (bags, D)."""
    acc = kernels.acc_dtype(g.dtype)
    q = bag_coefficient_sq(module, *inputs, g.shape[0], acc)
    return {"weight": q * kernels.row_sq(g.to(acc))}


def embedding_bag_check(module: nn.EmbeddingBag) -> None:
    """ValueError with ``scale_grad_by_freq``: the gradient is scaled by counts over the whole batch."""
    if module.scale_grad_by_freq:
        raise ValueError("per-example norms are not defined for nn.EmbeddingBag(scale_grad_by_freq=True): "
                         "its gradient depends on the whole batch")


register_rule(nn.EmbeddingBag, None, params=("weight",), fused=embedding_bag_forward,
              check=embedding_bag_check)
