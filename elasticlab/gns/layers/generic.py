"""The fallback rule: any leaf module (no children) with no rule of its own, such as the RMSNorm classes of
Hugging Face's LLaMA, Mistral, Qwen and Gemma, T5's LayerNorm or a LayerScale. Its per-example gradients are
formed by ``torch.func``: ``vmap`` over the examples of the ``vjp`` of the module's own forward at the
example's input and output gradient, ∇θ ℓ_b = J_θ f(θ, x_b)ᵀ δ_b, and their squared norms summed in the
wider dtype. Exact, with the memory of B per-example gradients of the module's own parameters (chunked to
:data:`CHUNK_BYTES`); meant for small layers, which the registered rules do not cover.

Valid only for a module that treats each example alone and deterministically. Before the first backward of
each input shape, the module's output on the batch is compared with its output on each example alone
(``vmap``, which also refuses random operations inside the forward): a module that mixes examples (batch
statistics) or draws random numbers is an error naming it, with the ways out. A call whose output does not
carry the batch (BART's positional embedding, handed its positions by keyword) is followed to where that
output is broadcast over the batch instead (``Rule.unbatched``, :mod:`.broadcast_params`). The call's
keyword arguments are passed too (``Rule.kwargs``: Whisper's positional embedding reads its positions so).
"""
from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from elasticlab.gns import kernels
from elasticlab.gns.broadcast import signature
from elasticlab.gns.registry import Rule, register_fallback
from elasticlab.gns.slot import Quiet

ENABLED = True                   # off: modules of no registered type are uncovered again (strict: an error)
CHUNK_BYTES = 256 << 20          # per-example gradients held at once, at most (one example whatever its size)

_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # module -> input signatures verified


def applies(module: nn.Module) -> bool:
    """With :data:`ENABLED`, leaf modules: a forward that calls no child module (whose own rule would run
    inside it again)."""
    return ENABLED and next(module.children(), None) is None


def own_params(module: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, _ in module.named_parameters(recurse=False))


def _split(inputs: tuple) -> tuple[list, int, tuple[str, ...]]:
    """A call's inputs as one flat list (its positional arguments, then its keyword arguments' values, which
    the hook passes as a trailing dict: ``Rule.kwargs``), the number of positional ones, and the keywords."""
    if inputs and isinstance(inputs[-1], dict):
        kw = inputs[-1]
        return [*inputs[:-1], *kw.values()], len(inputs) - 1, tuple(kw)
    return list(inputs), len(inputs), ()


def _per_example_forward(module: nn.Module, dims: tuple, n_args: int, keys: tuple, rows: bool = False,
                         picks: tuple | None = None):
    """``one(params, *flat)``: the module's forward on one example (batched inputs given a batch of 1, or,
    with ``rows``, as that example's rows), with ``params`` in place of its own; ``flat`` its positional
    arguments, then the values of ``keys``. ``picks``: of a tuple output, the positions kept."""
    def one(params, *flat):
        flat = [a.unsqueeze(0) if d == 0 and not rows else a for a, d in zip(flat, dims)]
        out = functional_call(module, params, tuple(flat[:n_args]), dict(zip(keys, flat[n_args:])),
                              strict=False, tie_weights=False)
        return out if picks is None else tuple(out[i] for i in picks)
    return one


def _verify(module: nn.Module, inputs: tuple, dims: tuple, one, what: str | None = None,
            fold=None) -> None:
    """Its output on the batch against its output on each example alone (with ``fold``, on each example's
    rows), once per input signature."""
    sig = signature(inputs, None)
    seen = _checked.setdefault(module, set())
    if sig in seen:
        return
    why = None
    flat, n, keys = _split(inputs)
    with torch.no_grad():
        full = type(module).forward(module, *flat[:n], **dict(zip(keys, flat[n:])))
        full = list(full) if isinstance(full, (tuple, list)) else [full]
        try:
            each = vmap(lambda *a: one({}, *a), in_dims=dims)(*_unfolded(flat, dims, fold))
        except RuntimeError as e:                            # random operations, data-dependent control flow
            why = f"its forward does not run on one example at a time under torch.func.vmap ({e})"
        else:
            each = list(each) if isinstance(each, (tuple, list)) else [each]
            if fold is None:
                each = [e.squeeze(1) if e.dim() > 1 else e for e in each]
            else:
                each = [fold.refold(e) if e.dim() > 1 else e for e in each]
            if not _same(full, each):
                why = "its output for an example depends on the other examples of the batch"
    if why is not None:
        what = what or (f"{type(module).__name__} has no per-example gradient-norm rule, and the generic one "
                        "(torch.func) does not apply:")
        raise RuntimeError(
            f"{what} {why}. Register a rule with elasticlab.gns.register_rule, freeze its parameters, or set "
            "elasticlab.gns.layers.generic.ENABLED = False before making PerSampleGradNorms (then "
            "strict=False leaves them out)")
    seen.add(sig)


def _same(full: list, each: list) -> bool:
    """The floating tensors of a module's output on the batch and as formed per example agree."""
    pairs = [(f, e) for f, e in zip(full, each) if isinstance(f, torch.Tensor) and f.is_floating_point()]
    if len(full) != len(each) or not pairs:
        return False
    for f, e in pairs:
        rtol, atol = (3e-2, 1e-3) if f.dtype in (torch.bfloat16, torch.float16) else (1e-3, 1e-5)
        atol *= max(float(f.abs().max()) if f.numel() else 0.0, 1.0)
        if e.shape != f.shape or not torch.allclose(e.to(f.dtype), f, rtol=rtol, atol=atol):
            return False
    return True


def _unfolded(flat: list, dims: tuple, fold) -> list:
    """A call's flat inputs with those of the fold's rows (dim 0 of ``fold``'s R rows) unfolded to
    (B, k, …); as they are without a fold."""
    if fold is None:
        return flat
    return [fold.unfold(a) if d == 0 else a for a, d in zip(flat, dims)]


def _widened(tensors: list, params: dict) -> list:
    """Inputs in bf16 or fp16 (a layer after an autocast matmul) in the parameters' wider dtype, for the
    re-runs in the backward, where autocast is off (and under vmap would not cast): the per-example
    gradients are then formed in that dtype from the inputs as they were."""
    wide = next((p.dtype for p in params.values() if p.dtype in (torch.float32, torch.float64)), None)
    if wide is None:
        return tensors
    return [t.to(wide) if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) else t
            for t in tensors]


def chunk_size(batch: int, params) -> int:
    """Examples per vmap chunk so that their per-example gradients of ``params`` (in float32 at least) stay
    under :data:`CHUNK_BYTES` (one example whatever its size)."""
    numel = sum(p.numel() * max(p.element_size(), 4) for p in params)
    return max(1, min(batch, CHUNK_BYTES // max(numel, 1)))


def generic_norms(module: nn.Module, inputs: tuple, d, need, fold=None) -> dict:
    """Hook rule: ‖∇θ ℓ_b‖² per example of each needed parameter, from the vjp of the module's forward on
    example b (vmap over the batch, in chunks of at most :data:`CHUNK_BYTES` of per-example gradients)."""
    return summed_norms(module, [(inputs, d)], need, fold=fold)


def summed_norms(module: nn.Module, calls: list, need, what: str | None = None, fold=None) -> dict:
    """‖Σ_k ∇θ ℓ_{b,k}‖² per example over the module's calls ``calls`` [(inputs, output gradient)] of one
    forward (one call: :func:`generic_norms`; several: :mod:`elasticlab.gns.repeated`): each call's vjp on
    example b, summed, then the norm; vmap over the batch in chunks. ``what`` heads a verification error.
    An output gradient may be a tuple (of a tuple output; None where an output carries none). With ``fold``
    (a call on rows that fold the batch: a mixture of experts' router on (B·T, D)), example b's input is
    its rows, checked to give the rows of the output on the batch (the module is then row-wise)."""
    d0 = calls[0][1]
    R = next(t for t in d0 if t is not None).shape[0] if isinstance(d0, tuple) else d0.shape[0]
    B = R if fold is None else fold.batch
    flat, dims, ones = [], [], []
    for inputs, d in calls:
        items, n, keys = _split(inputs)
        dk = tuple(0 if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == R else None
                   for a in items)
        picks = None if not isinstance(d, tuple) else tuple(i for i, t in enumerate(d) if t is not None)
        gs = [d] if picks is None else [d[i] for i in picks]
        one = _per_example_forward(module, dk, n, keys, rows=fold is not None, picks=picks)
        with Quiet():
            _verify(module, tuple(_widened(list(inputs), dict(module.named_parameters(recurse=False)))),
                    dk, _per_example_forward(module, dk, n, keys, rows=fold is not None), what, fold)
        ones.append((one, len(items), len(gs), picks is not None))
        flat += _unfolded([*items, *gs], (*dk, *(0,) * len(gs)), fold)
        dims += [*dk, *(0,) * len(gs)]
    params = {n: module.get_parameter(n).detach() for n in need}
    flat = _widened(flat, params)
    chunk = chunk_size(B, params.values())
    lift = (lambda t: t) if fold is not None else (lambda t: t.unsqueeze(0))

    def grads(*a):
        total, i = None, 0
        for one, n, m, tupled in ones:
            args, g = a[i:i + n], a[i + n:i + n + m]
            i += n + m
            _, pull = vjp(lambda p: one(p, *args), params)          # noqa: B023  (called at once)
            gk = pull(tuple(map(lift, g)) if tupled else lift(g[0]))[0]
            total = gk if total is None else {k: total[k] + gk[k] for k in total}
        return total

    with torch.enable_grad(), Quiet():
        per = vmap(grads, in_dims=tuple(dims), chunk_size=chunk)(*flat)
    return {n: kernels.row_sq(v.reshape(B, -1).to(kernels.acc_dtype(v.dtype))) for n, v in per.items()}


register_fallback(Rule(norms=generic_norms, params=own_params, unbatched=True, kwargs=True, rows=True,
                       outputs=True), applies)
