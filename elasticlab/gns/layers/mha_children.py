"""``F.multi_head_attention_forward`` handed its children's weights: a module that owns q/k/v/out projection
Linears and passes their weights to the functional attention itself (Hugging Face's WavLM, ported from
fairseq: ``use_separate_proj_weight=True``, ``in_proj_bias`` the three biases concatenated, the inputs
sequence-first). No child is called, so no rule sees the projections.

Such a call, met by the followed children's weights (:mod:`.broadcast_params`), is run as the children's
own calls on the batch-first inputs, so that each child's slot records its norms by the Linear rule (a
sequence Linear, G_b = Σ_t δ_{b,t} a_{b,t}ᵀ), around the attention core of ``nn.MultiheadAttention``'s rule
(:func:`.attention._attention`: the same masks merged in the same order, dropout, and the weights averaged
or not). It is taken only where every weight and bias is a child's own (the concatenated bias equal to the
children's biases in q, k, v order) and the call uses no ``bias_k``/``bias_v``, zero attention, static
keys or ``is_causal``; otherwise the call goes on to the usual refusal naming the parameter.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from elasticlab.gns.layers.attention import _attention, _canonical_mask

_SIG = inspect.signature(F.multi_head_attention_forward)
_NONE = ("bias_k", "bias_v", "static_k", "static_v")         # (forms left to the refusal)


class _Heads:
    """What :func:`.attention._attention` reads of its module."""
    __slots__ = ("num_heads", "dropout", "training")

    def __init__(self, num_heads: int, dropout: float, training: bool):
        self.num_heads, self.dropout, self.training = num_heads, dropout, training


def _child(t, pn: str):
    """The child module whose parameter ``pn`` the followed tensor ``t`` is, else None."""
    root = getattr(t, "_root", None)
    return root[1].module if root is not None and root[0] == "child" and root[2] == pn else None


def _bias_matches(bias, children: list) -> bool:
    """Whether ``in_proj_bias`` is the children's biases concatenated (None where none has one)."""
    own = [c.bias for c in children]
    if bias is None or all(b is None for b in own):
        return bias is None and all(b is None for b in own)
    if any(b is None for b in own):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return bias.shape == (sum(b.numel() for b in own),) and torch.equal(bias, torch.cat(own))


def run(args: tuple, kwargs: dict):
    """The call's (output, weights) by the children's own calls, or None where it is not such a call."""
    try:
        bound = _SIG.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    p = bound.arguments
    if not p["use_separate_proj_weight"] or any(p.get(k) is not None for k in _NONE) or p["add_zero_attn"] \
            or p.get("is_causal"):
        return None
    q_c, k_c, v_c = (_child(p[f"{n}_proj_weight"], "weight") for n in "qkv")
    out_c = _child(p["out_proj_weight"], "weight")
    if None in (q_c, k_c, v_c, out_c) or not _bias_matches(p["in_proj_bias"], [q_c, k_c, v_c]):
        return None
    if (p["out_proj_bias"] is None) != (out_c.bias is None) or (
            p["out_proj_bias"] is not None and _child(p["out_proj_bias"], "bias") is not out_c):
        return None
    query, key, value = p["query"], p["key"], p["value"]
    if any(t.dim() != 3 for t in (query, key, value)):
        return None
    # batch first; transposed views keep the `is` relations of self-attention
    q_in = query.transpose(0, 1)
    k_in = q_in if key is query else key.transpose(0, 1)
    v_in = k_in if value is key else (q_in if value is query else value.transpose(0, 1))
    q, k, v = q_c(q_in), k_c(k_in), v_c(v_in)            # (the children's slots record their norms)
    B, L, S, H = q.shape[0], q.shape[1], k.shape[1], p["num_heads"]
    kpm = _canonical_mask(p["key_padding_mask"], q.dtype)
    mask = _canonical_mask(p["attn_mask"], q.dtype)
    if mask is not None and mask.dim() == 2:
        mask = mask.unsqueeze(0)
    if mask is not None and mask.shape not in ((1, L, S), (B * H, L, S)):
        return None
    o, weights = _attention(_Heads(H, p["dropout_p"], p["training"]), q, k, v, kpm, mask,
                            p["need_weights"], p["average_attn_weights"], False)
    return out_c(o).transpose(0, 1), weights
