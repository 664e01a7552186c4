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

A subclass whose forward scales the lookup by a constant (the scaled word embeddings of Gemma, BART, mBART
and Pegasus: ``super().forward(ids) * embed_scale``, Vaswani et al. 2017 §3.4) is this rule at c·δ
(:func:`scale_of`, checked on its first call); another subclass (BART's positional embedding) takes the
generic rule.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import EagerUnderCompile, along_positions, batched
from elasticlab.gns.registry import Rule, register_fallback, register_rule
from elasticlab.gns.sharded import DTensor


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


_scales: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()    # module -> c, or None (not a scaling)


@EagerUnderCompile
def scale_of(module: nn.Embedding, idx: torch.Tensor) -> float | None:
    """c where the module's own forward is c times the plain lookup, read off (and checked on) its output on
    the first example, once per module (no graph); None where it is something else. Run eagerly under
    torch.compile, where a forward of another signature (OPT's positions, from the attention mask) would
    fail to trace rather than raise."""
    if module in _scales:
        return _scales[module]
    x, c = idx[:1], None
    w = module.weight
    if isinstance(w, DTensor) and not isinstance(x, DTensor):      # a table split by tensor parallelism: the
        from torch.distributed.tensor import Replicate
        mesh = w.device_mesh                                       # lookup on every process, made whole
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    try:
        with torch.no_grad():
            out = type(module).forward(module, x)
            plain = F.embedding(x, w, module.padding_idx)
            out, plain = (t.full_tensor() if isinstance(t, DTensor) else t for t in (out, plain))
    except (TypeError, RuntimeError, IndexError):                  # another signature, float input, ...
        out = plain = None
    if isinstance(out, torch.Tensor) and plain is not None and out.shape == plain.shape:
        o, p = out.double(), plain.double()
        den = float(p.pow(2).sum())
        if den > 0:
            c = float((o * p).sum()) / den
            tol = 1e-2 if out.dtype in (torch.bfloat16, torch.float16) else 1e-6
            c = c if torch.allclose(o, c * p, rtol=tol, atol=tol * abs(c) * float(p.abs().max())) else None
    _scales[module] = c
    return c


def scaled_embedding_norms(module: nn.Embedding, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule of an nn.Embedding subclass with a forward of its own: the embedding rule at c·δ where that
    forward scales the lookup by c, else the generic rule (torch.func)."""
    from elasticlab.gns.layers.generic import generic_norms  # (its fallback registers after this one)
    c = scale_of(module, inputs[0])
    if c is None:
        return generic_norms(module, inputs, d, need)
    return embedding_norms(module, inputs, d * c, need)


def _own_forward(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward


register_fallback(Rule(norms=scaled_embedding_norms, params=("weight",), unbatched=True, kwargs=True),
                  _own_forward)
register_rule(nn.Embedding, embedding_norms, params=("weight",),
              summed=along_positions(embedding_norms, lambda m: 0, lambda m: 1), unbatched=True)
