"""Per-layer rules for per-example gradient norms, in a registry keyed by module type, as Opacus' grad_sample.

A rule's ``norms(module, inputs, grad_output, need)`` returns {param name: (B,) squared norms} of the
per-example gradients *of the loss as reduced* (no B² rescaling; the caller applies it), computed from the
layer inputs and the gradient of its output, for the direct parameters named in ``need``. Its optional
``fused(module, slot)`` returns a replacement forward whose backward forms the parameter gradients and the
norms in one pass (see :mod:`elasticlab.gns.fused`), or None when that configuration is not supported.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import kernels


@dataclass(frozen=True)
class Rule:
    norms: Callable
    params: tuple[str, ...] = ("weight", "bias")
    fused: Callable | None = None


RULES: dict[type, Rule] = {}


def register_rule(module_type: type, norms: Callable, *, params=("weight", "bias"), fused=None) -> Rule:
    """Register (or replace) the rule for ``module_type``; returns it."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise ValueError(f"register_rule: expected an nn.Module subclass, got {module_type!r}")
    rule = Rule(norms=norms, params=tuple(params), fused=fused)
    RULES[module_type] = rule
    return rule


def rule_for(module: nn.Module) -> Rule | None:
    """The rule of the nearest registered base class whose ``forward`` the module still uses."""
    for cls in type(module).__mro__:
        rule = RULES.get(cls)
        if rule is not None:
            return rule if type(module).forward is cls.forward else None
    return None


def row_sq(x: torch.Tensor) -> torch.Tensor:
    """‖x_b‖² per row of x viewed as (B, -1) (kernel ``row_sq_norms`` when built)."""
    x = x.reshape(x.shape[0], -1)
    if x.dtype in (torch.float32, torch.float64):
        op = kernels._ext.kernel("row_sq_norms", x.device.type)
        if op is not None:
            return op(x)
    return torch.einsum("bi,bi->b", x, x)


def _batched(module: nn.Module, x: torch.Tensor, min_dim: int) -> None:
    if x.dim() < min_dim:
        raise ValueError(f"per-example norms need a batch dimension first: {type(module).__name__} got an "
                         f"input of shape {tuple(x.shape)}")


def seq_weight_norms(a: torch.Tensor, d: torch.Tensor, fused_outer: bool = False) -> torch.Tensor:
    """‖Σ_t d_t a_tᵀ‖² per example, the cheaper of the Gram and outer-product forms for this layer."""
    T, din, dout = a.shape[1], a.shape[2], d.shape[2]
    if kernels.use_gram(T, din, dout, fused_outer):
        return kernels.seq_linear_gram_norms(a, d)
    return kernels.seq_linear_outer_norms(a, d)[0]


# -------------------------------------------------------------------------------------------- Linear
def linear_norms(module: nn.Linear, inputs, d: torch.Tensor, need) -> dict:
    """Linear: 2-D inputs ‖a_b‖²·‖d_b‖² (Goodfellow 2015); sequences (B,…,Din) Gram or outer form."""
    a = inputs[0]
    _batched(module, a, 2)
    out = {}
    if a.dim() == 2:
        if "weight" in need:
            out["weight"] = row_sq(a) * row_sq(d)
        if "bias" in need:
            out["bias"] = row_sq(d)
        return out
    B = a.shape[0]
    a3, d3 = a.reshape(B, -1, a.shape[-1]), d.reshape(B, -1, d.shape[-1])
    if "weight" in need:
        out["weight"] = seq_weight_norms(a3, d3)
    if "bias" in need:
        out["bias"] = row_sq(d3.sum(1))
    return out


# -------------------------------------------------------------------------------------------- Conv
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
    """Conv1d/Conv2d as a Linear over the L output positions of the unfolded input, per group."""
    x = inputs[0]
    nd = 1 if isinstance(module, nn.Conv1d) else 2
    _batched(module, x, nd + 2)
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
        out["bias"] = row_sq(d3.sum(2))
    return out


# -------------------------------------------------------------------------------------------- LayerNorm
def layernorm_stats(x3: torch.Tensor, eps: float):
    var, mean = torch.var_mean(x3, dim=-1, unbiased=False)
    return mean, torch.rsqrt(var + eps)


def layernorm_norms(module: nn.LayerNorm, inputs, d: torch.Tensor, need) -> dict:
    """LayerNorm: Σ_t d_t ⊙ x̂_t (weight) and Σ_t d_t (bias) per example (Gray et al. 2024)."""
    x = inputs[0]
    D = math.prod(module.normalized_shape)
    _batched(module, x, len(module.normalized_shape) + 1)
    B = x.shape[0]
    x3, d3 = x.reshape(B, -1, D), d.reshape(B, -1, D)
    mean, rstd = layernorm_stats(x3, module.eps)
    gw, gb = kernels.layernorm_per_example(x3, d3, mean, rstd)
    out = {}
    if "weight" in need:
        out["weight"] = row_sq(gw)
    if "bias" in need:
        out["bias"] = row_sq(gb)
    return out


# -------------------------------------------------------------------------------------------- Embedding
def embedding_norms(module: nn.Embedding, inputs, d: torch.Tensor, need) -> dict:
    """Embedding: rows of one example that share an index add up before the norm (segment sum by index)."""
    if module.scale_grad_by_freq:
        raise ValueError("per-example norms are not defined for nn.Embedding(scale_grad_by_freq=True): its "
                         "gradient depends on the whole batch")
    idx = inputs[0]
    _batched(module, idx, 1)
    B, D, V = idx.shape[0], d.shape[-1], module.num_embeddings
    idx2, d2 = idx.reshape(B, -1), d.reshape(B, -1, D)
    if module.padding_idx is not None:
        d2 = d2.masked_fill((idx2 == module.padding_idx).unsqueeze(-1), 0)
    key = (torch.arange(B, device=idx.device).unsqueeze(1) * V + idx2).reshape(-1)
    uniq, inv = torch.unique(key, return_inverse=True)
    rows = d2.new_zeros(uniq.numel(), D).index_add_(0, inv, d2.reshape(-1, D))
    per = d2.new_zeros(B).index_add_(0, torch.div(uniq, V, rounding_mode="floor"), row_sq(rows))
    return {"weight": per} if "weight" in need else {}


def _fused(name):
    def make(module, slot):
        from elasticlab.gns import fused
        return getattr(fused, name)(module, slot)
    return make


register_rule(nn.Linear, linear_norms, fused=_fused("linear_forward"))
register_rule(nn.Conv1d, conv_norms, fused=_fused("conv_forward"))
register_rule(nn.Conv2d, conv_norms, fused=_fused("conv_forward"))
register_rule(nn.LayerNorm, layernorm_norms, fused=_fused("layernorm_forward"))
register_rule(nn.Embedding, embedding_norms, params=("weight",))
