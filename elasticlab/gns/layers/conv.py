"""``nn.Conv1d`` / ``nn.Conv2d``: a Linear over the L output positions of the unfolded input, per group.

Hook rule and fused backward. Fused, the weight norms come either from the Gram form over the unfolded input
(while ATen's own backward forms the weight gradient), or from per-example weight gradients whose batch sum is
the weight gradient: on CUDA one batched GEMM per chunk of examples over the unfolded input (the same
outer-product operator as a sequence Linear), on the CPU as the weight gradient of one convolution with
c·groups groups (the batch folded into channels; Goodfellow 2015's trick), measured faster there. The choice
is per layer, by :func:`elasticlab.gns.form_choice.use_gram`. With :data:`TRITON_ON_CUDA`, convolutions on
CUDA may instead take the implicit-GEMM Triton kernel (:mod:`elasticlab.gns.triton_conv`). Fused calls go to
the C++ autograd function ``elasticlab::conv_norms`` (the Gram, patch and grouped forms), or under
``torch.compile`` and for the Triton kernel to :class:`_ConvNorms`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab._ext import conv_out_sizes
from elasticlab.gns import calibrate, form_choice, kernels, triton_conv
from elasticlab.gns.layers.common import autocast_dtype, batched, cast
from elasticlab.gns.layers.linear import seq_weight_norms
from elasticlab.gns.registry import register_rule
from elasticlab.gns.sink import deliver, sink_for

# Unfolded-input elements per chunk of a Conv's backward: bounds its scratch memory (4 MB on the CPU;
# 256 MB of float32 on CUDA, where fewer, larger launches matter more).
CONV_CHUNK_ELEMS = {"cpu": 1 << 20, "cuda": 1 << 26}


# The CPU's form on CUDA too: per-example weight gradients as the weight gradient of one grouped convolution
# (cuDNN), with no unfolded input written. Off until measured on a GPU against the batched GEMM over the
# patches (``benchmarks/bench_psgnorm.py``'s ``psgn-convgrouped``).
GROUPED_ON_CUDA = False
# Convolutions on CUDA (one group, half precision) by the implicit-GEMM Triton kernel of
# :mod:`elasticlab.gns.triton_conv`: no unfolded input and no per-example products in memory. Off until
# measured on a GPU (``benchmarks/bench_psgnorm.py``'s ``psgn-convtriton``).
TRITON_ON_CUDA = False


def _chunk_elems(x: torch.Tensor) -> int:
    return CONV_CHUNK_ELEMS.get(x.device.type, CONV_CHUNK_ELEMS["cpu"])


def padded_input(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(x, padding) for the convolution's own geometry: a padding mode other than zeros, or a string padding,
    is applied to x here (zero padding is left to the convolution)."""
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        return F.pad(x, module._reversed_padding_repeated_twice, mode=mode), (0,) * len(module.kernel_size)
    return x, module.padding


def conv_unfold(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """im2col of a Conv1d/Conv2d input: (B, Cin·k, L), padding modes and string paddings included."""
    nd = 1 if isinstance(module, nn.Conv1d) else 2
    x, padding = padded_input(module, x)
    if nd == 1:
        x = x.unsqueeze(2)
        k, s, p, dil = (1, *module.kernel_size), (1, *module.stride), (0, *padding), (1, *module.dilation)
    else:
        k, s, p, dil = module.kernel_size, module.stride, padding, module.dilation
    return F.unfold(x, k, dilation=dil, padding=p, stride=s)


def conv_patches(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """im2col as (B, L, Cin·k), position-major (the layout of a sequence Linear's input), by
    :func:`elasticlab.gns.kernels.conv_patches` (one pass; ATen's ``F.unfold`` on CUDA launches one im2col
    kernel per example, which took 66% of G2's kernel time on an H100). Columns are ordered (channel, kernel
    offsets) like ``weight.view(Cout, -1)``, so group g owns the columns [g·K/G, (g+1)·K/G). Padding modes
    other than zeros, and string paddings, are applied first."""
    x, padding = padded_input(module, x)
    return kernels.conv_patches(x, module.kernel_size, module.stride, padding, module.dilation)


def conv_norms(module: nn.Module, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: Conv1d/Conv2d as a Linear over the L output positions of the unfolded input, per group."""
    x = inputs[0]
    nd = 1 if isinstance(module, nn.Conv1d) else 2
    batched(module, x, nd + 2)
    x = cast(x, d.dtype)
    B, G = x.shape[0], module.groups
    out = {}
    d3 = d.reshape(B, d.shape[1], -1)                          # (B, Cout, L)
    if "weight" in need:
        K, L, cog = module.weight[0].numel(), d3.shape[2], d3.shape[1] // G
        dd = d3.view(B, G, cog, L)
        out["weight"] = sum(seq_weight_norms(a, dd[:, gi].transpose(1, 2))        # a: (B, L, K) per group
                            for gi, a in enumerate(_patches(module, x, G, K)))
    if "bias" in need:
        out["bias"] = kernels.row_sq(d3.sum(2, dtype=kernels.acc_dtype(d3.dtype)))
    return out


class _ConvNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, slot, dtype, sink=None):
        ctx.slot, ctx.module, ctx.sink = slot, module, None if sink is None else sink.dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        xc, wc, bc = cast(x, dtype), cast(weight, dtype), cast(bias, dtype)
        ctx.save_for_backward(xc, wc)
        conv = F.conv1d if isinstance(module, nn.Conv1d) else F.conv2d
        if dtype is None:
            return conv(xc, wc, bc, module.stride, module.padding, module.dilation, module.groups)
        with torch.autocast(x.device.type, enabled=False):
            return conv(xc, wc, bc, module.stride, module.padding, module.dilation, module.groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        m = ctx.module
        g = cast(g, x.dtype)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        B, G = x.shape[0], m.groups
        cout = w.shape[0]
        d3 = g.reshape(B, cout, -1)
        L = d3.shape[2]
        K = w[0].numel()                                    # Cin/G · k
        measured = need_w and calibrate.active()
        tf32 = kernels.conv_takes_tf32(x)
        gram = need_w and not measured and form_choice.use_gram(L, K, cout // G, fused_outer=True, like=x,
                                                                batch=B * G, row_major=False, tf32=tf32)
        gx, gw_native, _ = torch.ops.aten.convolution_backward(
            g, x, w, None, list(m.stride), list(m.padding), list(m.dilation), False,
            [0] * len(m.stride), G, [need_x, bool(gram), False])
        norms = {}
        gw = gw_native
        if need_w:
            with kernels.tf32_mode(tf32):
                norms["weight"], gw = _weight_norms(m, x, g, w, d3, gram, measured, gw)
        gb = None
        if need_b:
            db = d3.sum(2, dtype=kernels.acc_dtype(d3.dtype))
            gb = db.sum(0)
            norms["bias"] = kernels.row_sq(db)
        sunk = deliver(ctx, norms, B)
        return cast(gx, x_dtype), cast(gw, w_dtype), cast(gb, b_dtype), None, None, None, sunk


def _weight_norms(m, x, g, w, d3, gram, measured, gw_native):
    """(‖G_b‖² (B,), the weight gradient) by the form :class:`_ConvNorms` chose."""
    G, K, L = m.groups, w[0].numel(), d3.shape[2]
    if measured:
        return _calibrated(m, x, g, w)
    if gram:
        return _conv_gram_norms(m, x, d3, G, K, L), gw_native
    if TRITON_ON_CUDA and triton_conv.supported(m, x):
        return triton_conv.conv_outer_norms(m, x, g, with_grad=True)
    if x.device.type == "cuda" and not GROUPED_ON_CUDA:
        return _conv_outer_unfolded(m, x, d3, w)
    return _conv_per_example(m, x, g, w)


def _patches(m, x: torch.Tensor, G: int, K: int) -> list[torch.Tensor]:
    """Per group, the (c, L, K) unfolded input of a chunk: :func:`conv_patches` on CUDA, ``F.unfold`` views
    (measured faster there) on the CPU."""
    if x.device.type == "cuda":
        P = conv_patches(m, x)
        return [P[:, :, gi * K:(gi + 1) * K] for gi in range(G)]
    U = conv_unfold(m, x)
    U = U.view(x.shape[0], G, K, U.shape[2])
    return [U[:, gi].transpose(1, 2) for gi in range(G)]


def _conv_gram_norms(m, x, d3, G, K, L):
    """Gram form over the L output positions of the unfolded input, chunk by chunk."""
    B, cout = x.shape[0], d3.shape[1]
    per = torch.empty(B, device=x.device, dtype=kernels.acc_dtype(x.dtype))
    step = max(1, _chunk_elems(x) // (K * G * L))
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        dg = d3[b0:b1].view(b1 - b0, G, cout // G, L)
        per[b0:b1] = sum(kernels.seq_linear_gram_norms(a, dg[:, gi].transpose(1, 2))
                         for gi, a in enumerate(_patches(m, x[b0:b1], G, K)))
    return per


def _conv_outer_unfolded(m, x, d3, w):
    """Per-example weight gradients as one batched GEMM per chunk over the unfolded input (CUDA): the
    outer-product operator on (L, K) and (L, Cout/G) views, its Σ_b G_b the weight gradient."""
    B, G, cout = x.shape[0], m.groups, w.shape[0]
    K, L, cog = w[0].numel(), d3.shape[2], cout // G
    per = torch.zeros(B, device=x.device, dtype=kernels.acc_dtype(x.dtype))
    gw = torch.zeros(G, cog, K, device=x.device, dtype=per.dtype)
    step = max(1, _chunk_elems(x) // (K * G * L))
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        dg = d3[b0:b1].view(b1 - b0, G, cog, L)
        for gi, a in enumerate(_patches(m, x[b0:b1], G, K)):
            n, s = kernels.seq_linear_outer_norms(a, dg[:, gi].transpose(1, 2), with_grad=True)
            per[b0:b1] += n
            gw[gi] += s
    return per, gw.view_as(w)


def grouped_weight_grads(x, g, w, geometry, transposed=False, output_padding=None, with_grad=True):
    """(‖G_b‖² (B,), Σ_b G_b or None) of a convolution (``transposed``: a transposed one) with ``geometry``
    (stride, padding, dilation, groups): the per-example weight gradients of c examples at once as the
    weight gradient of one convolution with c·groups groups (the batch folded into the channels; Goodfellow
    2015's trick), chunk by chunk."""
    stride, padding, dilation, groups = geometry
    B, nd = x.shape[0], x.dim() - 2
    acc = kernels.acc_dtype(x.dtype)
    per = torch.empty(B, dtype=acc, device=x.device)
    gw = torch.zeros(w.shape, dtype=acc, device=x.device) if with_grad else None
    step = max(1, min(32, _chunk_elems(x) // w.numel()))
    for b0 in range(0, B, step):
        b1 = min(B, b0 + step)
        c = b1 - b0
        xg = x[b0:b1].reshape(1, c * x.shape[1], *x.shape[2:])
        gg = g[b0:b1].reshape(1, c * g.shape[1], *g.shape[2:])
        wg = w.unsqueeze(0).expand(c, *w.shape).reshape(c * w.shape[0], *w.shape[1:])
        pe = torch.ops.aten.convolution_backward(
            gg, xg, wg, None, list(stride), list(padding), list(dilation), transposed,
            list(output_padding or [0] * nd), c * groups, [False, True, False])[1].view(c, *w.shape)
        per[b0:b1] = kernels.row_sq(pe)
        if with_grad:
            gw += pe.sum(0)
    return per, gw


def _conv_per_example(m, x, g, w):
    """:func:`grouped_weight_grads` of a Conv1d/Conv2d (CPU, or CUDA with :data:`GROUPED_ON_CUDA`)."""
    return grouped_weight_grads(x, g, w, (m.stride, m.padding, m.dilation, m.groups))


def conv_forms(m: nn.Module, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> dict:
    """The fused forms of a convolution's weight norms, each a call returning (‖G_b‖² (B,), Σ_b G_b):
    ``patches`` (batched GEMMs over the unfolded input), ``gram`` (Gram form over it, plus cuDNN's weight
    gradient), ``grouped`` (one grouped convolution's weight gradient) and, where it serves the layer,
    ``triton`` (the implicit GEMM of :mod:`elasticlab.gns.triton_conv`). The candidates of
    :mod:`elasticlab.gns.calibrate`."""
    B, G, cout = x.shape[0], m.groups, w.shape[0]
    d3 = g.reshape(B, cout, -1)
    K, L = w[0].numel(), d3.shape[2]

    def gram():
        gw = torch.ops.aten.convolution_backward(
            g, x, w, None, list(m.stride), list(m.padding), list(m.dilation), False, [0] * len(m.stride), G,
            [False, True, False])[1]
        return _conv_gram_norms(m, x, d3, G, K, L), gw

    forms = {"patches": lambda: _conv_outer_unfolded(m, x, d3, w), "gram": gram,
             "grouped": lambda: _conv_per_example(m, x, g, w)}
    if triton_conv.supported(m, x):
        forms["triton"] = lambda: triton_conv.conv_outer_norms(m, x, g, with_grad=True)
    return forms


_CONV_CXX = {"patches": 0, "gram": 1, "grouped": 2}     # calibrated form -> the C++ function's form


def _conv_key(m: nn.Module, shape, dtype: torch.dtype, device: torch.device) -> tuple:
    return calibrate.key_of("conv", type(m).__name__, tuple(shape), tuple(m.weight.shape), m.stride,
                            m.padding, m.dilation, m.groups, dtype, device)


def conv_scratch(m: nn.Module, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> dict[str, int]:
    """Modelled scratch bytes of :func:`conv_forms`' forms beyond the unfolded input they share (calibration's
    memory rule): the outer form's per-example products and the Gram form's Grams as
    :func:`elasticlab.gns.form_choice.scratch_bytes` models them (per group), the grouped form's per-example
    gradients and expanded weight of a chunk; the Triton kernel's partial norms are negligible."""
    B, G, cout = x.shape[0], m.groups, w.shape[0]
    K, L = w[0].numel(), g[0, 0].numel()
    acc = torch.empty(0, dtype=kernels.acc_dtype(x.dtype)).element_size()
    chunk = max(1, min(B, 32, _chunk_elems(x) // w.numel()))
    return {"patches": form_choice.scratch_bytes("outer", B * G, L, K, cout // G, x.dtype),
            "gram": form_choice.scratch_bytes("gram", B * G, L, K, cout // G, x.dtype),
            "grouped": chunk * w.numel() * (acc + x.element_size())}


def _calibrated(m, x, g, w):
    """(‖G_b‖², Σ_b G_b) by the form measured fastest for this layer's shape (measured at the first call)."""
    return calibrate.run(_conv_key(m, x.shape, x.dtype, x.device), conv_forms(m, x, g, w), x.device,
                         conv_scratch(m, x, g, w))


def _cxx_form(module: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> int | None:
    """The C++ function's form for this input shape, as :class:`_ConvNorms` chooses it: 1 Gram, else 0 (the
    outer form over the patches, CUDA) or 2 (one grouped convolution: CPU, or CUDA with
    :data:`GROUPED_ON_CUDA`); None for a layer the Triton kernel takes (:data:`TRITON_ON_CUDA`; launched from
    Python, so :class:`_ConvNorms` serves it). With :data:`elasticlab.gns.calibrate.ENABLED`, the form
    measured fastest for the shape, and None (the Python function, which measures) until it has been."""
    if calibrate.ENABLED:
        return _CONV_CXX.get(calibrate.chosen(_conv_key(module, x.shape, dtype or x.dtype, x.device)))
    like = torch.empty(0, dtype=dtype or x.dtype, device=x.device)
    L = math.prod(conv_out_sizes(x.shape[2:], module.kernel_size, module.stride, module.padding,
                                 module.dilation))
    K, G = module.weight[0].numel(), module.groups
    if form_choice.use_gram(L, K, module.out_channels // G, fused_outer=True, like=like, batch=x.shape[0] * G,
                            row_major=False, tf32=kernels.conv_takes_tf32(x, like.dtype)):
        return 1
    if TRITON_ON_CUDA and triton_conv.supported(module, like):
        return None
    return 0 if (x.is_cuda and not GROUPED_ON_CUDA) else 2


_MISSING = object()


def conv_forward(module: nn.Module, slot):
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return None                                         # the hook form handles these
    nd = 1 if isinstance(module, nn.Conv1d) else 2
    forms: dict[tuple, int | None] = {}        # (shape, dtype, on CUDA, autocast dtype, switches) -> form
    params = module._parameters
    geometry = (list(module.stride), list(module.padding), list(module.dilation), module.groups)

    def forward(x):
        if x.dim() != nd + 2:
            raise ValueError(f"per-example norms need a batch dimension first: {type(module).__name__} got "
                             f"shape {tuple(x.shape)}")
        slot.called()
        dtype = autocast_dtype(x)
        op = kernels.cxx_autograd("conv_norms", x)
        if op is not None:               # C++ autograd function: the backward fills the (weight, bias) rows
            tf32 = kernels.conv_takes_tf32(x, dtype)
            if calibrate.ENABLED:          # not cached: the choice is made at the shape's first backward
                form = _cxx_form(module, x, dtype)
            else:
                key = (x.shape, x.dtype, x.is_cuda, dtype, TRITON_ON_CUDA, GROUPED_ON_CUDA, tf32)
                form = forms.get(key, _MISSING)
                if form is _MISSING:
                    form = forms[key] = _cxx_form(module, x, dtype)
            if form is not None:
                buf = slot.buffer(x.shape[0], kernels.acc_dtype(dtype or x.dtype), x.device)
                return op(x, params["weight"], params.get("bias"), *geometry, buf, form, _chunk_elems(x),
                          dtype, tf32)
        return _ConvNorms.apply(x, module.weight, module.bias, module, slot, dtype, sink_for(slot, x))
    return forward


register_rule(nn.Conv1d, conv_norms, fused=conv_forward)
register_rule(nn.Conv2d, conv_norms, fused=conv_forward)
