"""``nn.Embedding``: rows of one example that share an index add up before the norm.

‖∇E ℓ_b‖² = Σ_v ‖Σ_{t: idx_{b,t}=v} δ_{b,t}‖². The segment sums over (example, index) keys
(:func:`segment_sums`, shared with :mod:`.embedding_bag`) are formed with a sort and a cumulative sum into a
buffer of fixed size (one row per position), so nothing waits on the host.
An embedding called on an index without the batch dimension (a positional embedding on ``arange(T)`` or on
Hugging Face's ``position_ids`` (1, T), T5's relative-position buckets), broadcast over the batch, receives
the batch-summed gradient, from which this rule cannot recover per-example norms: such a call (dim 0 not the
model's batch) is followed instead to where its output is broadcast (``unbatched=True``,
:mod:`.broadcast_params`). Where the index's dim 0 happens to equal the batch, the broadcast audit
(:mod:`elasticlab.gns.broadcast`) makes the readers raise: expand the index over the batch then
(``pos.unsqueeze(0).expand(B, -1)``).
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import along_positions, batched
from elasticlab.gns.registry import register_rule


def segment_sums(example: torch.Tensor, index: torch.Tensor, size: int, values: torch.Tensor):
    """Sums of ``values`` (N,) or (N, D) over the positions sharing an (example, index) key, index < ``size``
    (``example`` and ``index`` broadcast to N positions): (sums, owner), one slot per position, the segments
    first in key order and the rest zero; ``owner`` is each segment's example (0 for the unused slots).
    A sort and a cumulative sum into buffers of fixed size: nothing waits on the host."""
    key = (example * size + index).reshape(-1)
    skey, order = torch.sort(key)
    first = torch.ones_like(skey, dtype=torch.bool)
    first[1:] = skey[1:] != skey[:-1]
    group = torch.cumsum(first, 0) - 1                               # segment id of each sorted position
    sums = values.new_zeros(values.shape).index_add_(0, group, values[order])
    owner = torch.zeros(key.numel(), dtype=torch.long, device=key.device)
    owner[group] = torch.div(skey, size, rounding_mode="floor")
    return sums, owner


def embedding_norms(module: nn.Embedding, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: per-example squared norm of the embedding-table gradient (segment sum by index)."""
    if module.scale_grad_by_freq:
        raise ValueError("per-example norms are not defined for nn.Embedding(scale_grad_by_freq=True): its "
                         "gradient depends on the whole batch")
    if "weight" not in need:
        return {}
    idx = inputs[0]
    batched(module, idx, 1)
    B, D, V = idx.shape[0], d.shape[-1], module.num_embeddings
    idx2 = idx.reshape(B, -1)
    d2 = d.reshape(B, -1, D)
    d2 = d2.to(kernels.acc_dtype(d2.dtype))
    if module.padding_idx is not None:
        d2 = d2.masked_fill((idx2 == module.padding_idx).unsqueeze(-1), 0)
    sums, owner = segment_sums(torch.arange(B, device=idx.device).unsqueeze(1), idx2, V, d2.reshape(-1, D))
    per = d2.new_zeros(B).index_add_(0, owner, kernels.row_sq(sums))
    return {"weight": per}


register_rule(nn.Embedding, embedding_norms, params=("weight",),
              summed=along_positions(embedding_norms, lambda m: 0, lambda m: 1), unbatched=True)
