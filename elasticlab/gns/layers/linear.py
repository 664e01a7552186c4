"""``nn.Linear``: per-example weight-gradient norms, by hooks or fused into the backward.

2-D inputs: ‖∇W ℓ_b‖² = ‖a_b‖²·‖δ_b‖² (Goodfellow 2015). Sequences (B, …, Din): G_b = Σ_t δ_{b,t} a_{b,t}ᵀ by
the Gram form or the outer-product form, whichever :func:`elasticlab.gns.form_choice.use_gram` finds cheaper
for the layer's shape and device ("mixed ghost clipping", Bu, Mao & Xu 2022). Fused, the outer-product form
*is* the weight-gradient GEMM: Σ_b G_b comes out of the same per-example products whose norms are taken.
Fused calls go to the C++ autograd function ``elasticlab::linear_norms`` (no Python in the backward), except
under ``torch.compile`` and for layers the Triton kernel serves, which take :class:`_LinearNorms`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from elasticlab import _ext
from elasticlab.gns import calibrate, form_choice, kernels, triton_outer, triton_tune
from elasticlab.gns.layers.common import along_positions, autocast_dtype, batched, cast
from elasticlab.gns.registry import register_rule, register_rule_by_name
from elasticlab.gns.sink import deliver, sink_for


def seq_weight_norms(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """‖Σ_t d_t a_tᵀ‖² per example, the cheaper of the Gram and outer-product forms for this layer."""
    if form_choice.use_gram(a.shape[1], a.shape[2], d.shape[2], fused_outer=False, like=a, batch=a.shape[0]):
        return kernels.seq_linear_gram_norms(a, d)
    return kernels.seq_linear_outer_norms(a, d)[0]


def summed_parts(module: nn.Module, calls, need) -> dict:
    """The ``summed`` form of a fused-only rule whose backward, for a repeated module
    (:mod:`elasticlab.gns.repeated`), kept each call's *parts* in its slot, ``(parts, B)``, a part being
    ``("seq", name, key, a (B, T, Din), δ (B, T, Dout))``, a sequence Linear block of parameter ``name``, or
    ``("rows", name, key, r (B, k))``, per-example gradient rows of it. The blocks of one (name, key) are
    concatenated over the calls along the positions (the Gram or outer form), the rows summed; the norms of
    a parameter's keys (disjoint blocks of it) add up."""
    seq: dict[tuple, list] = {}
    rows: dict[tuple, list] = {}
    for parts, _ in calls:
        for kind, name, key, *ts in parts:
            if name in need:
                (seq if kind == "seq" else rows).setdefault((name, key), []).append(ts)
    out: dict[str, torch.Tensor] = {}
    for (name, _), ts in seq.items():
        v = seq_weight_norms(torch.cat([t[0] for t in ts], 1), torch.cat([t[1] for t in ts], 1))
        out[name] = v if name not in out else out[name] + v
    for (name, _), ts in rows.items():
        r = torch.stack([t[0].to(kernels.acc_dtype(t[0].dtype)) for t in ts]).sum(0)
        v = kernels.row_sq(r)
        out[name] = v if name not in out else out[name] + v
    return out


def linear_norms(module: nn.Linear, inputs, d: torch.Tensor, need) -> dict:
    """Hook rule: 2-D inputs ‖a_b‖²·‖d_b‖²; sequences (B,…,Din) by the Gram or outer form."""
    a = inputs[0]
    batched(module, a, 2)
    a = cast(a, d.dtype)                                   # autocast ran the layer in the gradient's dtype
    out = {}
    if a.dim() == 2:
        d_sq = kernels.row_sq(d)
        if "weight" in need:
            out["weight"] = kernels.row_sq(a) * d_sq
        if "bias" in need:
            out["bias"] = d_sq
        return out
    B = a.shape[0]
    a3, d3 = a.reshape(B, -1, a.shape[-1]), d.reshape(B, -1, d.shape[-1])
    if "weight" in need:
        out["weight"] = seq_weight_norms(a3, d3)
    if "bias" in need:
        out["bias"] = kernels.row_sq(d3.sum(1, dtype=kernels.acc_dtype(d3.dtype)))
    return out


def seq_forms(a: torch.Tensor, d: torch.Tensor) -> dict:
    """The fused forms of a sequence Linear's weight norms for a (B,T,Din), d (B,T,Dout), each a call
    returning (‖G_b‖² (B,), Σ_b G_b): ``outer`` (the compiled operator: cuBLAS batched GEMMs and the fold on
    CUDA), ``gram`` (Gram form, plus the weight-gradient GEMM), and where the Triton kernel takes the inputs
    (row-major), the forms :func:`elasticlab.gns.triton_tune.forms` times, named ``triton-`` and theirs
    (``triton-pointer-nested``, ``triton-tma-flat-wide``, ``triton-ghost``, …). The candidates of
    :mod:`elasticlab.gns.calibrate`."""
    compiled = kernels.compiled("seq_linear_outer_norms", a)
    forms = {"outer": lambda: kernels.seq_linear_outer_norms(a, d, with_grad=True, use_kernel=compiled),
             "gram": lambda: (kernels.seq_linear_gram_norms(a, d),
                              d.reshape(-1, d.shape[2]).t().mm(a.reshape(-1, a.shape[2])))}
    if triton_outer.supported(a) and a.stride(-1) == 1 and d.stride(-1) == 1:
        forms.update({f"triton-{name}": call for name, (call, _) in triton_tune.forms(a, d, True).items()})
    return forms


def seq_scratch(a: torch.Tensor, d: torch.Tensor, forms) -> dict[str, int]:
    """Modelled scratch bytes of each of :func:`seq_forms`' ``forms`` (for calibration's memory rule)."""
    (B, T, din), dout = a.shape, d.shape[2]
    out = {f: form_choice.scratch_bytes(f, B, T, din, dout, a.dtype) for f in ("outer", "gram")}
    if any(f.startswith("triton-") for f in forms):
        for name, (_, config) in triton_tune.forms(a, d, True).items():
            out[f"triton-{name}"] = triton_tune.scratch_bytes(a, d, config)
    return out


def _seq_key(B: int, T: int, din: int, dout: int, dtype: torch.dtype, device: torch.device) -> tuple:
    return calibrate.key_of("linear", B, T, din, dout, dtype, device)


def _calibrated(a: torch.Tensor, d: torch.Tensor):
    """(‖G_b‖², Σ_b G_b) by the form measured fastest for this shape (measuring it on the first call)."""
    forms = seq_forms(a, d)
    return calibrate.run(_seq_key(*a.shape, d.shape[2], a.dtype, a.device), forms, a.device,
                         seq_scratch(a, d, forms))


class _LinearNorms(torch.autograd.Function):
    """y = x Wᵀ + b; backward: input gradient, Σ_b G_b and the per-example norms together."""

    @staticmethod
    def forward(ctx, x, weight, bias, slot, dtype, sink=None):
        ctx.slot, ctx.dtypes = slot, (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.sink = None if sink is None else sink.dtype
        if dtype is None:                                  # no autocast: no casts (the common case)
            xc, wc = x, weight
            out = F.linear(x, weight, bias)
        else:
            xc, wc, bc = cast(x, dtype), cast(weight, dtype), cast(bias, dtype)
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(xc, wc, bc)
        # ‖a_b‖² of 2-D inputs now, while x is still in cache from the layer that made it.
        ctx.x_sq = kernels.row_sq(xc) if xc.dim() == 2 and ctx.needs_input_grad[1] else None
        ctx.save_for_backward(xc, wc)
        # a sequence input's output is a view of F.linear's 2-D product, which nothing else sees: made a
        # tensor of its own, an in-place op on it (h += r: Falcon's MLP) is not refused as one on a custom
        # Function's view (under compile always, where the query would break the graph)
        if not torch.compiler.is_compiling() and not out._is_view():
            return out
        return torch.ops.aten._unsafe_view(out, out.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if g.dtype != x.dtype:
            g = g.to(x.dtype)
        gx = g.matmul(w) if need_x else None
        if gx is not None and gx.dtype != x_dtype:
            gx = gx.to(x_dtype)
        gw = gb = None
        norms = {}
        B = x.shape[0]
        acc = kernels.acc_dtype(g.dtype)                          # sums of half-precision values in fp32
        if x.dim() == 2:
            g_sq = kernels.row_sq(g) if (need_w or need_b) else None
            if need_w:
                gw = g.t().mm(x)
                norms["weight"] = (ctx.x_sq if ctx.x_sq is not None else kernels.row_sq(x)) * g_sq
            if need_b:
                gb = g.sum(0, dtype=acc)
                norms["bias"] = g_sq
        else:
            a, d = x.reshape(B, -1, x.shape[-1]), g.reshape(B, -1, g.shape[-1])
            db = None                                             # per-example bias gradients (B, Dout)
            if need_w:
                if calibrate.active():
                    norms["weight"], gw = _calibrated(a, d)
                elif form_choice.use_gram(a.shape[1], a.shape[2], d.shape[2], fused_outer=True, like=a,
                                          batch=B):
                    norms["weight"] = kernels.seq_linear_gram_norms(a, d)
                    gw = d.reshape(-1, d.shape[2]).t().mm(a.reshape(-1, a.shape[2]))
                else:                    # the bias sums too: the Triton kernel takes them from its δ tiles
                    norms["weight"], gw, *rest = kernels.seq_linear_outer_norms(a, d, with_grad=True,
                                                                                bias=need_b)
                    db = rest[0] if rest else None
            if need_b:
                if db is None:
                    db = d.sum(1, dtype=acc)
                gb = db.sum(0)
                norms["bias"] = kernels.row_sq(db)
        sunk = deliver(ctx, norms, B)
        if gw is not None and gw.dtype != w_dtype:
            gw = gw.to(w_dtype)
        if gb is not None and gb.dtype != b_dtype:
            gb = gb.to(b_dtype)
        return gx, gw, gb, None, None, sunk


def _cxx_form(module: nn.Linear, x: torch.Tensor, dtype: torch.dtype | None) -> int | None:
    """How the C++ autograd function forms this call's norms: 0 outer product (cuBLAS), 1 Gram; None for a
    sequence layer the Triton fused kernel takes (launched from Python: the autograd.Function serves it).
    With :data:`elasticlab.gns.calibrate.ENABLED`, the form measured fastest for the shape, and None (the
    Python function, which measures) until it has been."""
    if x.dim() == 2:
        return 0
    T, din, dout = x[0].numel() // x.shape[-1], x.shape[-1], module.weight.shape[0]
    if calibrate.ENABLED:
        name = calibrate.chosen(_seq_key(x.shape[0], T, din, dout, dtype or x.dtype, x.device))
        return {"outer": 0, "gram": 1}.get(name)
    like = torch.empty(0, dtype=dtype or x.dtype, device=x.device)
    if form_choice.use_gram(T, din, dout, fused_outer=True, like=like, batch=x.shape[0]):
        return 1
    if x.stride(-1) == 1 and triton_outer.takes(like, T, din, dout):
        return None
    return 0


def _choice(module: nn.Linear, x: torch.Tensor, dtype: torch.dtype | None) -> tuple:
    """(:func:`_cxx_form`, the chunk budget of its cuBLAS outer form or None:
    :func:`elasticlab.gns.form_choice.outer_chunk_budget`)."""
    form = _cxx_form(module, x, dtype)
    if form != 0 or x.dim() == 2 or not x.is_cuda:
        return form, None
    return form, form_choice.outer_chunk_budget(x.shape[0], x.shape[-1], module.weight.shape[0],
                                                dtype or x.dtype, x.device)


_MISSING = object()


def linear_forward(module: nn.Linear, slot):
    forms: dict[tuple, tuple] = {}             # (shape, dtype, on CUDA, autocast dtype) -> _choice
    params = module._parameters                # (a dict lookup, not nn.Module.__getattr__, per call)

    def forward(x):
        if x.dim() < 2:
            raise ValueError("per-example norms need a batch dimension first: Linear got shape "
                             f"{tuple(x.shape)}")
        slot.called()
        dtype = autocast_dtype(x)
        op = kernels.cxx_autograd("linear_norms", x)
        if op is not None:
            if calibrate.ENABLED:              # not cached: the choice is made at the shape's first backward
                form, budget = _cxx_form(module, x, dtype), None
            else:
                key = (x.shape, x.dtype, x.is_cuda, dtype)
                choice = forms.get(key, _MISSING)
                if choice is _MISSING:
                    choice = forms[key] = _choice(module, x, dtype)
                form, budget = choice
            if form is not None:               # the C++ backward fills the slot's (weight, bias) rows
                buf = slot.buffer(x.shape[0], kernels.acc_dtype(dtype or x.dtype), x.device)
                # a budget of its own: set for the call, which keeps it for its backward's chunks
                prev = None if budget is None else _ext.set_scratch_bytes(budget)
                try:
                    return op(x, params["weight"], params.get("bias"), buf, form, dtype)
                finally:
                    if prev is not None:
                        _ext.set_scratch_bytes(prev)
        return _LinearNorms.apply(x, module.weight, module.bias, slot, dtype, sink_for(slot, x))
    return forward


_summed = along_positions(linear_norms, lambda m: 1, lambda m: 1)
register_rule(nn.Linear, linear_norms, fused=linear_forward, summed=_summed, folds=True)
# Hugging Face's Conv1D (GPT-2's projections): y = x W + b, a Linear with W transposed, whose per-example
# norms are the Linear rule's (on hooks); registered when a model first shows one, without importing it
register_rule_by_name("transformers.pytorch_utils", "Conv1D", linear_norms, summed=_summed, folds=True)
