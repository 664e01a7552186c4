"""``nn.MultiheadAttention``: per-example norms of its bare projection parameters and of ``out_proj``.

MHA's forward (``F.multi_head_attention_forward``) uses ``in_proj_weight`` (or ``q/k/v_proj_weight``) and
``out_proj.weight`` directly, never calling ``out_proj``'s forward, and returns a tuple: no hook sees its
projections. The rule is therefore a fused form only (used with ``fused=False`` too): a replacement forward
that re-implements ``F.multi_head_attention_forward`` (same masks, ``is_causal``, dropout and
``need_weights`` semantics, batch first or not) from pieces whose backward records the norms:

- the in-projection is one autograd Function over the distinct inputs (self-attention: one input and all 3E
  rows of ``in_proj_weight``; ``key is value``: the query's E rows and the key's 2E rows; else three blocks).
  Each block is a sequence Linear, G_b = Σ_t δ_{b,t} a_{b,t}ᵀ, its norm by the Gram or the outer-product form
  (:func:`elasticlab.gns.form_choice.use_gram`, as :mod:`.linear`). The blocks own disjoint rows of the weight
  (and of ``in_proj_bias``), so the per-example squared norms of the blocks add up;
- ``bias_k`` / ``bias_v`` (``add_bias_kv``): each example attends to its own copy, whose gradient is the
  per-example gradient;
- the output projection *calls* ``self.out_proj``, so its own slot (the ``nn.Linear`` rule, which
  ``NonDynamicallyQuantizableLinear`` resolves to) records its norms, fused or by hooks, as for any Linear
  (hooks registered on ``out_proj`` by the user now run too).

The projections run in the autocast dtype (as ``F.linear`` under autocast); the attention itself runs under
the ambient autocast state, as in the original forward.

The rule is registered with ``calls_children``: an MHA whose own parameters are all frozen while ``out_proj``
trains still gets the replacement forward (with nothing of its own to record), so ``out_proj`` is called and
records its norms.

An MHA called several times in one forward (a block applied at every depth, a siamese text encoder;
:mod:`elasticlab.gns.repeated`) keeps each call's projection blocks and bias rows instead of their norms, and
:func:`elasticlab.gns.layers.linear.summed_parts` forms the norms of the summed gradients when they are read.

Unsupported: unbatched inputs and nested tensors.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab.gns import form_choice, kernels
from elasticlab.gns.layers.common import autocast_dtype, cast
from elasticlab.gns.layers.linear import summed_parts
from elasticlab.gns.registry import register_rule
from elasticlab.gns.sink import deliver, sink_for

PARAMS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k",
          "bias_v")
_MARK = "_elasticlab_gns_mha"

class _ProjNorms(torch.autograd.Function):
    """Per-group sequence Linears y_g = x_g W_gᵀ + b_g over rows [r0, r1) of a weight and rows
    [c0, c0 + r1 − r0) of the bias; backward: input gradients, weight/bias gradients and per-example squared
    norms, the norms of the groups of one parameter summed (disjoint rows)."""

    @staticmethod
    def forward(ctx, plan, slot, dtype, *tensors):
        n_x, wnames, bname, groups = plan
        xs, ws, b, sink = tensors[:n_x], tensors[n_x:n_x + len(wnames)], tensors[-2], tensors[-1]
        ctx.plan, ctx.slot, ctx.sink = plan, slot, None if sink is None else sink.dtype
        ctx.dtypes = ([x.dtype for x in xs], [w.dtype for w in ws], None if b is None else b.dtype)
        ctx.b_len = 0 if b is None else b.shape[0]
        xc, wc, bc = [cast(x, dtype) for x in xs], [cast(w, dtype) for w in ws], cast(b, dtype)
        outs = []
        with torch.autocast(xs[0].device.type, enabled=False):
            for xi, wi, r0, r1, c0 in groups:
                bg = None if bc is None else bc[c0:c0 + r1 - r0]
                outs.append(F.linear(xc[xi], wc[wi][r0:r1], bg))
        ctx.save_for_backward(*xc, *wc)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        n_x, wnames, bname, groups = ctx.plan
        saved = ctx.saved_tensors
        xc, wc = saved[:n_x], saved[n_x:]
        x_dtypes, w_dtypes, b_dtype = ctx.dtypes
        need = ctx.needs_input_grad[3:]
        need_x, need_w = need[:n_x], need[n_x:n_x + len(wnames)]
        need_b = bname is not None and need[-2]
        B = xc[0].shape[0]
        gxs, gws, wsq = [None] * n_x, [None] * len(wnames), [None] * len(wnames)
        gb = bsq = None
        keep = [] if ctx.slot.shared and ctx.sink is None else None     # repeated: its parts (gns.repeated)
        for g, (xi, wi, r0, r1, c0) in zip(grads, groups):
            a, w = xc[xi], wc[wi][r0:r1]
            d = cast(g, a.dtype)
            acc = kernels.acc_dtype(d.dtype)
            if need_x[xi]:
                part = d.matmul(w)
                gxs[xi] = part if gxs[xi] is None else gxs[xi] + part
            a3, d3 = a.reshape(B, -1, a.shape[-1]), d.reshape(B, -1, d.shape[-1])
            if need_w[wi]:
                T, din, dout = a3.shape[1], a3.shape[2], d3.shape[2]
                if keep is not None:      # by q/k/v block: calls may group them differently (self, cross)
                    blk = wc[wi].shape[0] // 3 if len(wnames) == 1 else wc[wi].shape[0]
                    keep.extend(("seq", wnames[wi], r, a3, d3[..., r - r0:r - r0 + blk])
                                for r in range(r0, r1, blk))
                    sq, gw = None, d3.reshape(-1, dout).t().mm(a3.reshape(-1, din))
                elif form_choice.use_gram(T, din, dout, fused_outer=True, like=a3, batch=B):
                    sq = kernels.seq_linear_gram_norms(a3, d3)
                    gw = d3.reshape(-1, dout).t().mm(a3.reshape(-1, din))
                else:
                    sq, gw = kernels.seq_linear_outer_norms(a3, d3, with_grad=True)
                if gws[wi] is None:
                    gws[wi] = torch.zeros(wc[wi].shape, dtype=acc, device=a.device)
                gws[wi][r0:r1] += gw
                if sq is not None:
                    wsq[wi] = sq if wsq[wi] is None else wsq[wi] + sq
            if need_b:
                db = d3.sum(1, dtype=acc)                                  # (B, r1 − r0)
                if gb is None:
                    gb = torch.zeros(ctx.b_len, dtype=acc, device=a.device)
                gb[c0:c0 + r1 - r0] += db.sum(0)
                if keep is not None:
                    blk = ctx.b_len // 3
                    keep.extend(("rows", bname, c, db[:, c - c0:c - c0 + blk])
                                for c in range(c0, c0 + r1 - r0, blk))
                else:
                    sq = kernels.row_sq(db)
                    bsq = sq if bsq is None else bsq + sq
        if keep is not None:
            ctx.slot.pending.append((keep, B))
            sunk = None
        else:
            norms = {name: v for name, v in zip(wnames, wsq) if v is not None}
            if bsq is not None:
                norms[bname] = bsq
            sunk = deliver(ctx, norms, B)
        gxs = [cast(gx, dt) for gx, dt in zip(gxs, x_dtypes)]
        gws = [cast(gw, dt) for gw, dt in zip(gws, w_dtypes)]
        return (None, None, None, *gxs, *gws, cast(gb, b_dtype), sunk)


class _CopyNorms(torch.autograd.Function):
    """A (1, 1, E) parameter copied to each example, (B, 1, E): ∇p ℓ_b is the gradient of example b's copy."""

    @staticmethod
    def forward(ctx, p, batch, dtype, slot, name, sink=None):
        ctx.slot, ctx.name, ctx.p_dtype = slot, name, p.dtype
        ctx.sink = None if sink is None else sink.dtype
        return cast(p, dtype).expand(batch, *p.shape[1:]).contiguous()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        if ctx.slot.shared and ctx.sink is None:             # repeated: this call's copies (gns.repeated)
            ctx.slot.pending.append(([("rows", ctx.name, 0, g.reshape(g.shape[0], -1))], g.shape[0]))
            sunk = None
        else:
            sunk = deliver(ctx, {ctx.name: kernels.row_sq(g)}, g.shape[0])
        gp = g.sum(0, keepdim=True, dtype=kernels.acc_dtype(g.dtype))
        return cast(gp, ctx.p_dtype), None, None, None, None, sunk


def _canonical_mask(mask, dtype):
    """A boolean mask as an additive float mask (−inf where True), as ``F._canonical_mask``."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise ValueError(f"only bool and floating masks are supported, got {mask.dtype}")
    return mask


def _in_projection(module, slot, query, key, value, dtype):
    """(q, k, v) each (B, ·, E) from batch-first inputs, through :class:`_ProjNorms`; inputs that are the same
    tensor are projected once."""
    E = module.embed_dim
    raw, distinct, idx = (query, key, value), [], []
    for t in raw:
        hit = next((i for i, u in enumerate(distinct) if u is t), None)
        if hit is None:
            distinct.append(t)
            hit = len(distinct) - 1
        idx.append(hit)
    if module._qkv_same_embed_dim:
        ws, wnames = [module.in_proj_weight], ("in_proj_weight",)
        groups, j = [], 0
        while j < 3:                                    # runs of one input over consecutive row blocks
            j1 = j
            while j1 + 1 < 3 and idx[j1 + 1] == idx[j]:
                j1 += 1
            groups.append((idx[j], 0, j * E, (j1 + 1) * E, j * E))
            j = j1 + 1
    else:
        ws = [module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
        wnames = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        groups = [(idx[j], j, 0, E, j * E) for j in range(3)]
    b = module.in_proj_bias
    plan = (len(distinct), wnames, None if b is None else "in_proj_bias", tuple(groups))
    outs = _ProjNorms.apply(plan, slot, dtype, *distinct, *ws, b, sink_for(slot, distinct[0]))
    blocks = []
    for out in outs:
        blocks.extend(out.split(E, dim=-1))
    return blocks


def _attention(module, q, k, v, kpm, attn_mask, need_weights, average_attn_weights, is_causal):
    """The core of ``F.multi_head_attention_forward`` on batch-first (B, L, E) / (B, S, E) projections:
    (output before out_proj (B, L, E), weights or None)."""
    B, L, E = q.shape
    S = k.shape[1]
    H = module.num_heads
    hd = E // H
    dropout_p = module.dropout if module.training else 0.0
    # The merged mask is indexed by b·H + h, as in F.multi_head_attention_forward.
    if kpm is not None:
        if kpm.shape != (B, S):
            raise RuntimeError(f"expected key_padding_mask of shape {(B, S)}, got {tuple(kpm.shape)}")
        kpm = kpm.view(B, 1, 1, S).expand(-1, H, -1, -1).reshape(B * H, 1, S)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm

    def heads(t):                                       # (B, T, E) → (B, H, T, hd)
        return t.view(B, t.shape[1], H, hd).transpose(1, 2)

    if need_weights:
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        qh, kh, vh = (heads(t).reshape(B * H, t.shape[1], hd) for t in (q, k, v))
        q_scaled = qh * math.sqrt(1.0 / float(hd))
        if attn_mask is not None:
            w = torch.baddbmm(attn_mask, q_scaled, kh.transpose(-2, -1))
        else:
            w = torch.bmm(q_scaled, kh.transpose(-2, -1))
        w = F.softmax(w, dim=-1)
        if dropout_p > 0.0:
            w = F.dropout(w, p=dropout_p)
        o = torch.bmm(w, vh).view(B, H, L, hd).transpose(1, 2).reshape(B, L, E)
        w = w.view(B, H, L, S)
        return o, (w.mean(dim=1) if average_attn_weights else w)
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(B, H, -1, S)
    o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask, dropout_p, is_causal)
    return o.transpose(1, 2).reshape(B, L, E), None


def _mha(module, slot, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
         is_causal):
    E, H = module.embed_dim, module.num_heads
    kpm = _canonical_mask(key_padding_mask, query.dtype)
    attn_mask = _canonical_mask(attn_mask, query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                           "module method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and kpm is None and not need_weights:
        attn_mask = None                                # SDPA's is_causal does the masking
    elif kpm is not None:
        is_causal = False                               # the merged mask is no longer causal

    def bfirst(t):
        return t if module.batch_first else t.transpose(0, 1)
    # Transposing views keep the `is` relations (self-attention, key is value) that the projection uses.
    q_in = bfirst(query)
    k_in = q_in if key is query else bfirst(key)
    v_in = k_in if value is key else (q_in if value is query else bfirst(value))
    B, L = q_in.shape[:2]
    S = k_in.shape[1]
    if q_in.shape[2] != E:
        raise ValueError(f"MultiheadAttention: expected query of embedding dimension {E}, got "
                         f"{tuple(query.shape)}")
    if k_in.shape[:2] != v_in.shape[:2] or k_in.shape[0] != B:
        raise ValueError(f"MultiheadAttention: key {tuple(key.shape)} and value {tuple(value.shape)} must "
                         "share batch and sequence dimensions with each other and the batch with the query "
                         f"{tuple(query.shape)}")
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (L, S):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(L, S)}.")
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (B * H, L, S):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(B * H, L, S)}.")
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")

    dtype = autocast_dtype(query)
    q, k, v = _in_projection(module, slot, q_in, k_in, v_in, dtype)
    extra = []
    if module.bias_k is not None and module.bias_v is not None:
        extra.append((_CopyNorms.apply(module.bias_k, B, k.dtype, slot, "bias_k", sink_for(slot, k)),
                      _CopyNorms.apply(module.bias_v, B, v.dtype, slot, "bias_v", sink_for(slot, v))))
    if module.add_zero_attn:
        extra.append((k.new_zeros(B, 1, E), v.new_zeros(B, 1, E)))
    for ek, ev in extra:                                 # bias_k/v first, then the zero position, as in F
        k, v = torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        kpm = None if kpm is None else F.pad(kpm, (0, 1))
    o, weights = _attention(module, q, k, v, kpm, attn_mask, need_weights, average_attn_weights, is_causal)
    out = module.out_proj(o)
    return (out if module.batch_first else out.transpose(0, 1)), weights


def mha_forward(module: nn.MultiheadAttention, slot):
    """The replacement forward (same signature as ``nn.MultiheadAttention.forward``)."""
    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.is_nested:
                raise ValueError("per-example norms of nn.MultiheadAttention: nested tensors are not "
                                 "supported")
            if t.dim() != 3:
                raise ValueError(f"per-example norms need a batch dimension: MultiheadAttention got an "
                                 f"unbatched {name} of shape {tuple(t.shape)}")
        slot.called()
        return _mha(module, slot, query, key, value, key_padding_mask, need_weights, attn_mask,
                    average_attn_weights, is_causal)
    setattr(forward, _MARK, True)
    return forward


register_rule(nn.MultiheadAttention, None, params=PARAMS, fused=mha_forward, calls_children=True,
              summed=summed_parts)
