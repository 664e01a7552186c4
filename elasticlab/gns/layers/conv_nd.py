"""``nn.Conv3d`` and ``nn.ConvTranspose1d/2d/3d``: per-example weight gradients as one grouped convolution's.

ATen has no unfold of 5-D inputs, and a transposed convolution is the input gradient of a convolution, so
neither is a Linear over unfolded patches as in :mod:`.conv`. Both take :mod:`.conv`'s other form: the
per-example weight gradients of a chunk of c examples are the weight gradient of one convolution with
c·groups groups (the batch folded into the channels, Goodfellow 2015), and ‖G_b‖² their squared norms;
∇b ℓ_b = Σ_s δ_{b,:,s} over the output positions s. Padding modes other than zeros, and string paddings, are
applied to the input first; a transposed convolution's ``output_size`` is read off the gradient's shape.
Hook rule only.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.conv import _ConvTransposeNd

from elasticlab.gns import kernels
from elasticlab.gns.layers.common import batched, cast
from elasticlab.gns.layers.conv import grouped_weight_grads, padded_input
from elasticlab.gns.registry import register_rule


def output_padding(module: _ConvTransposeNd, x: torch.Tensor, d: torch.Tensor) -> list[int]:
    """The output padding a transposed convolution ran with (its ``output_size`` argument can set it per
    call): out = (in − 1)·stride − 2·padding + dilation·(k − 1) + output_padding + 1, per dimension."""
    return [d.shape[2 + i] - ((x.shape[2 + i] - 1) * s - 2 * p + dil * (k - 1) + 1)
            for i, (s, p, dil, k) in enumerate(zip(module.stride, module.padding, module.dilation,
                                                   module.kernel_size))]


def grouped_conv_norms(module: nn.Module, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: ‖G_b‖² by :func:`~.conv.grouped_weight_grads`, ‖Σ_s δ_b‖² for the bias."""
    nd = len(module.kernel_size)
    x = inputs[0]
    batched(module, x, nd + 2)
    x = cast(x, d.dtype)
    out = {}
    if "weight" in need:
        transposed = isinstance(module, _ConvTransposeNd)
        if transposed:                      # (zero padding only, as PyTorch allows)
            padding, op = module.padding, output_padding(module, x, d)
        else:
            (x, padding), op = padded_input(module, x), None
        w = cast(module.weight.detach(), d.dtype)
        geometry = (module.stride, padding, module.dilation, module.groups)
        out["weight"] = grouped_weight_grads(x, d, w, geometry, transposed, op, with_grad=False)[0]
    if "bias" in need:
        d3 = d.reshape(d.shape[0], d.shape[1], -1)
        out["bias"] = kernels.row_sq(d3.sum(2, dtype=kernels.acc_dtype(d.dtype)))
    return out


for _cls in (nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
    register_rule(_cls, grouped_conv_norms)
