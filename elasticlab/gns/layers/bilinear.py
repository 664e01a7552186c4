"""``nn.Bilinear``: y_k = x1ᵀ W_k x2 + b_k, so each example's weight gradient is a sum of outer products.

For one position, ∇W ℓ = δ ⊗ x1 ⊗ x2 and ‖∇W ℓ‖² = ‖δ‖²‖x1‖²‖x2‖². Over the positions t of a sequence
(B, T, ·) it is Σ_t δ_t ⊗ x1_t ⊗ x2_t, whose squared norm is the Gram form
Σ_{t,s} (δ_t·δ_s)(x1_t·x1_s)(x2_t·x2_s) (three (T, T) Grams per example, never the (out, in1, in2)
gradient); the bias's is ‖Σ_t δ_t‖². Hook rule only, computed in float32 or wider.
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import batched, cast, wider
from elasticlab.gns.registry import register_rule


def bilinear_norms(module: nn.Bilinear, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: products of row norms (2-D inputs), or the Gram form over the positions."""
    x1, x2 = inputs[0], inputs[1]
    batched(module, x1, 2)
    dt = kernels.acc_dtype(wider(x1, x2, d))
    B = x1.shape[0]
    a, c, g = (cast(t, dt).reshape(B, -1, t.shape[-1]) for t in (x1, x2, d))
    out = {}
    if "weight" in need:
        if a.shape[1] == 1:
            out["weight"] = kernels.row_sq(g[:, 0]) * kernels.row_sq(a[:, 0]) * kernels.row_sq(c[:, 0])
        else:
            grams = [torch.bmm(t, t.transpose(1, 2)) for t in (g, a, c)]
            out["weight"] = (grams[0] * grams[1] * grams[2]).sum((1, 2))
    if "bias" in need:
        out["bias"] = kernels.row_sq(g.sum(1))
    return out


register_rule(nn.Bilinear, bilinear_norms)
