"""The fallback rule: any leaf module (no children) with no rule of its own, such as the RMSNorm classes of
Hugging Face's LLaMA, Mistral, Qwen and Gemma, T5's LayerNorm or a LayerScale. Its per-example gradients are
formed by ``torch.func``: ``vmap`` over the examples of the ``vjp`` of the module's own forward at the
example's input and output gradient, ∇θ ℓ_b = J_θ f(θ, x_b)ᵀ δ_b, and their squared norms summed in the
wider dtype. Exact, with the memory of B per-example gradients of the module's own parameters (chunked to
:data:`CHUNK_BYTES`); meant for small layers, which the registered rules do not cover.

Valid only for a module that treats each example alone and deterministically. Before the first backward of
each input shape, the module's output on the batch is compared with its output on each example alone
(``vmap``, which also refuses random operations inside the forward): a module that mixes examples (batch
statistics) or draws random numbers is an error naming it, with the ways out. A forward that vmap cannot
run for its data-dependent control flow (a mixture of experts' loop over the experts its tokens reach,
GPT-OSS's) takes the examples one at a time by a Python loop, checked the same way. A call on rows that
fold the batch ((B·T, D), in its inputs or only in its output; ``Rule.rows``) runs on each example's rows,
so a row-wise module (a router) is read exactly; a tuple output (``Rule.outputs``) gives the vjp its
gradient-carrying outputs together. A call whose output does not
carry the batch (BART's positional embedding, handed its positions by keyword) is followed to where that
output is broadcast over the batch instead (``Rule.unbatched``, :mod:`.broadcast_params`). The call's
keyword arguments are passed too (``Rule.kwargs``: Whisper's positional embedding reads its positions so).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils.stateless import _reparametrize_module

from elasticlab.gns import kernels
from elasticlab.gns.broadcast import signature
from elasticlab.gns.layers.common import as_forward
from elasticlab.gns.registry import Rule, register_fallback
from elasticlab.gns.sharded import PARTIAL
from elasticlab.gns.slot import Quiet

ENABLED = True                   # off: modules of no registered type are uncovered again (strict: an error)
CHUNK_BYTES = 256 << 20          # per-example gradients held at once, at most (one example whatever its size)

_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # module -> {signature: by a loop}


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


_BATCH, _ROWS = 1, 2             # an argument's dim 0: the batch (one example: a batch of 1), or folded rows


def _kinds(items: list, B: int, R: int) -> tuple:
    """For each of a call's arguments: :data:`_BATCH` where dim 0 is the batch, :data:`_ROWS` where it is the
    R rows that fold it (R > B), else None (shared by the examples)."""
    def kind(a):
        if not (isinstance(a, torch.Tensor) and a.dim() > 0):
            return None
        return _BATCH if a.shape[0] == B else _ROWS if R != B and a.shape[0] == R else None
    return tuple(kind(a) for a in items)


def _per_example_forward(module: nn.Module, kinds: tuple, n_args: int, keys: tuple,
                         picks: tuple | None = None, direct: bool = False):
    """``one(params, *flat)``: the module's forward on one example (its arguments of :data:`_BATCH` given as
    a batch of 1, those of :data:`_ROWS` as that example's rows), with ``params`` in place of its own;
    ``flat`` its positional arguments, then the values of ``keys``. ``picks``: of a tuple output, the
    positions kept. ``direct``: its class's forward itself, so that no hook of the module runs (under
    torch.compile, where :class:`Quiet`'s counter would be a side effect the traced backward cannot
    hold; a leaf module calls no other)."""
    def one(params, *flat):
        flat = [a.unsqueeze(0) if k == _BATCH else a for a, k in zip(flat, kinds)]
        args, kw = tuple(flat[:n_args]), dict(zip(keys, flat[n_args:]))
        if direct:
            with _reparametrize_module(module, params, tie_weights=False, strict=False):
                out = type(module).forward(module, *args, **kw)
        else:
            out = functional_call(module, params, args, kw, strict=False, tie_weights=False)
        return out if picks is None else tuple(out[i] for i in picks)
    return one


def _examples(flat: list, kinds: tuple, fold) -> list:
    """A call's flat arguments with their examples along dim 0: those of :data:`_ROWS` unfolded to
    (B, k, …)."""
    return [fold.unfold(a) if k == _ROWS else a for a, k in zip(flat, kinds)]


def _each(one, flat: list, kinds: tuple, fold, loop: bool):
    """``one({}, ...)`` on each example, stacked along dim 0 (vmap, or with ``loop`` a Python loop)."""
    dims = tuple(0 if k else None for k in kinds)
    per = _examples(flat, kinds, fold)
    if not loop:
        return vmap(lambda *a: one({}, *a), in_dims=dims)(*per)
    B = next(a.shape[0] for a, k in zip(per, kinds) if k)
    outs = [one({}, *(a[b] if k else a for a, k in zip(per, kinds))) for b in range(B)]
    if isinstance(outs[0], (tuple, list)):
        return [torch.stack([o[i] for o in outs]) if isinstance(outs[0][i], torch.Tensor) else outs[0][i]
                for i in range(len(outs[0]))]
    return torch.stack(outs)


def _verify(module: nn.Module, inputs: tuple, kinds: tuple, one, what: str | None = None,
            fold=None) -> bool:
    """Its output on the batch against its output on each example alone (an example's rows where the call
    folds them), once per input signature; True where the examples are taken one at a time by a Python
    loop (a forward with data-dependent control flow, which vmap does not run: the experts of a mixture
    of experts, each run on the tokens routed to it)."""
    sig = signature(inputs, None)
    seen = _checked.setdefault(module, {})
    if sig in seen:
        return seen[sig]
    why, loop = None, False
    flat, n, keys = _split(inputs)
    B, R = (fold.batch, fold.batch * fold.per) if fold is not None else (None, None)
    with torch.no_grad():
        full = type(module).forward(module, *flat[:n], **dict(zip(keys, flat[n:])))
        full = list(full) if isinstance(full, (tuple, list)) else [full]
        try:
            if not any(kinds):
                raise ValueError("none of its inputs has the batch, or rows that fold it, along dim 0")
            each = _each(one, flat, kinds, fold, False)
        except ValueError as e:
            why = str(e)
        except RuntimeError as e:
            if "random" in str(e):                           # random operations inside the forward
                why = f"its forward does not run on one example at a time under torch.func.vmap ({e})"
            else:                                            # data-dependent control flow: one at a time
                loop = True
                try:
                    each = _each(one, flat, kinds, fold, True)
                except RuntimeError as e2:
                    why = f"its forward does not run on one example at a time ({e2})"
        if why is None:
            each = _as_batch(each, full, fold, B, R)
            if not _same(full, each):
                why = "its output for an example depends on the other examples of the batch"
    if why is not None:
        what = what or (f"{type(module).__name__} has no per-example gradient-norm rule, and the generic one "
                        "(torch.func) does not apply:")
        raise RuntimeError(
            f"{what} {why}. Register a rule with elasticlab.gns.register_rule, freeze its parameters, or set "
            "elasticlab.gns.layers.generic.ENABLED = False before making PerSampleGradNorms (then "
            "strict=False leaves them out)")
    seen[sig] = loop
    return loop


def _as_batch(each, full: list, fold, B, R) -> list:
    """The per-example outputs (stacked along dim 0) in the layout of the batch's outputs ``full``."""
    each = list(each) if isinstance(each, (tuple, list)) else [each]
    return [e if not isinstance(e, torch.Tensor) or e.dim() < 2 else
            fold.refold(e) if fold is not None and f.dim() and f.shape[0] == R and R != B else
            e.squeeze(1) for e, f in zip(each, full)]


def _agree(module: nn.Module, inputs: tuple, kinds: tuple, one, fold, B, R) -> torch.Tensor:
    """Under torch.compile, :func:`_verify`'s check as a 0-dim bool tensor, every step and without a side
    effect (vmap, never the loop): whether the module's output on the batch is its output on each example
    alone; where not, the caller's norms are NaN (skipped and counted by the estimator)."""
    flat, n, keys = _split(inputs)
    with torch.no_grad():
        full = type(module).forward(module, *flat[:n], **dict(zip(keys, flat[n:])))
        full = list(full) if isinstance(full, (tuple, list)) else [full]
        each = _as_batch(_each(one, flat, kinds, fold, False), full, fold, B, R)
    return _agreement(full, each)


def _agreement(full: list, each: list) -> torch.Tensor:
    """(0-dim bool) The floating tensors of a module's output on the batch and as formed per example agree:
    within rtol, and atol times the output's largest magnitude (at least 1), both wider in 16 bits."""
    pairs = [(f, e) for f, e in zip(full, each) if isinstance(f, torch.Tensor) and f.is_floating_point()]
    ok = torch.ones((), dtype=torch.bool, device=pairs[0][0].device if pairs else None)
    if len(full) != len(each) or not pairs or any(e.shape != f.shape for f, e in pairs):
        return ~ok
    for f, e in pairs:
        rtol, atol = (3e-2, 1e-3) if f.dtype in (torch.bfloat16, torch.float16) else (1e-3, 1e-5)
        scale = f.abs().amax().clamp_min(1.0) if f.numel() else f.new_ones(())
        ok = ok & ((e.to(f.dtype) - f).abs() <= atol * scale + rtol * f.abs()).all()
    return ok


def _same(full: list, each: list) -> bool:
    """:func:`_agreement` read on the host (eager)."""
    return bool(_agreement(full, each))


def _widened(tensors: list, params: dict) -> list:
    """Inputs in bf16 or fp16 (a layer after an autocast matmul) in the parameters' wider dtype, for the
    re-runs in the backward: the per-example gradients are formed in that dtype from the inputs as they
    were, and the ops that autocast ran in 16 bits (a router's ``F.linear``) run so again, under the call's
    autocast state (``Rule.reruns``), casting the widened inputs back exactly."""
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
    example b, summed, then the norm; vmap over the batch in chunks (or a loop over the examples where the
    forward's control flow depends on the data). ``what`` heads a verification error. An output gradient
    may be a tuple (of a tuple output; None where an output carries none). With ``fold``, the layout of
    the call's rows that fold the batch (in its inputs or its output: a mixture of experts' router and
    experts on (B·T, D)), example b's input or output is its rows, checked to give the rows of the call on
    the batch (the module is then row-wise)."""
    d0 = calls[0][1]
    B = fold.batch if fold is not None else (
        next(t for t in d0 if t is not None) if isinstance(d0, tuple) else d0).shape[0]
    R = B * fold.per if fold is not None else B
    traced = torch.compiler.is_compiling()        # (then no side effect: no hooks, no cache, no loop)
    group = PARTIAL.get(module)                   # (each process holds a part of every example's gradient)
    # transformers' grad all-reduce hook, registered again by a forward pre-hook that meets other parameters,
    # would double that gradient at each step: no hook of the module on its gradient in parts
    direct = traced or group is not None
    quiet = contextlib.nullcontext if traced else Quiet
    flat, kinds, ones, loop, agree = [], [], [], False, []
    for inputs, d, *kept_state in calls:        # (a call's autocast state, where the caller did not set it)
        state = kept_state[0] if kept_state else None
        items, n, keys = _split(inputs)
        ik = _kinds(items, B, R)
        picks = None if not isinstance(d, tuple) else tuple(i for i, t in enumerate(d) if t is not None)
        gs = [d] if picks is None else [d[i] for i in picks]
        gk = _kinds(gs, B, R)
        own = dict(module.named_parameters(recurse=False))
        with quiet(), as_forward(state):
            wide, one = tuple(_widened(list(inputs), own)), _per_example_forward(module, ik, n, keys,
                                                                                 direct=direct)
            if traced:
                agree.append(_agree(module, wide, ik, one, fold, B, R))
            else:
                loop |= _verify(module, wide, ik, one, what, fold)
        ones.append((_per_example_forward(module, ik, n, keys, picks, direct=direct), len(items), gk,
                     picks is not None, state))
        flat += [*items, *gs]
        kinds += [*ik, *gk]
    params = {n: module.get_parameter(n).detach() for n in need}
    flat = _examples(_widened(flat, params), tuple(kinds), fold)

    def grads(*a):
        total, i = None, 0
        for one, n, gk, tupled, state in ones:
            args, g = a[i:i + n], a[i + n:i + n + len(gk)]
            i += n + len(gk)
            g = tuple(t.unsqueeze(0) if k == _BATCH else t for t, k in zip(g, gk))
            with as_forward(state):                                 # (the forward as it ran: autocast)
                _, pull = vjp(lambda p: one(p, *args), params)      # noqa: B023  (called at once)
            got = pull(g if tupled else g[0])[0]
            total = got if total is None else {k: total[k] + got[k] for k in total}
        return total

    with torch.enable_grad(), quiet():
        if loop:
            rows = [grads(*(a[b] if k else a for a, k in zip(flat, kinds))) for b in range(B)]
            per = {n: torch.stack([r[n] for r in rows]) for n in params}
        else:
            per = vmap(grads, in_dims=tuple(0 if k else None for k in kinds),
                       chunk_size=chunk_size(B, params.values()))(*flat)
    if group is not None:        # the parts of every example's gradient summed first
        per = {n: v.contiguous() for n, v in per.items()}
        for v in per.values():
            dist.all_reduce(v, group=group)
    out = {n: kernels.row_sq(v.reshape(B, -1).to(kernels.acc_dtype(v.dtype))) for n, v in per.items()}
    if agree:
        ok = torch.stack(agree).all()
        out = {n: torch.where(ok, v, torch.full_like(v, float("nan"))) for n, v in out.items()}
    return out


register_fallback(Rule(norms=generic_norms, params=own_params, unbatched=True, kwargs=True, rows=True,
                       outputs=True, reruns=True), applies)
