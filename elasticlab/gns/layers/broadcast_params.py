"""Bare parameters broadcast over the batch by a module with children: a Vision Transformer's class token and
position embedding (Dosovitskiy et al. 2021, eq. 1: z₀ = [x_class; x_p¹E; …; x_pᴺE] + E_pos; timm's
``cls_token`` / ``pos_embed``, Hugging Face's ``ViTEmbeddings``, torchvision's ``class_token`` /
``pos_embedding``), and learned queries or latents expanded over the batch.

Such a parameter p reaches the examples through a broadcast: ``p.expand(B, …)`` (or ``repeat``, ``tile``,
``broadcast_to``, ``expand_as``), an elementwise op with a batched tensor (``x + p``), or as the additive
``attn_mask`` of ``scaled_dot_product_attention``; also on rows that fold the batch with windows (Swin's
relative position bias on its B·nW windows' scores: each example's rows summed,
:class:`~elasticlab.gns.layers.broadcast_taps.Rows`). Its per-example
gradient is then example b's slice of the gradient of that broadcast's result, ∇p ℓ_b = ∂ℓ/∂e_b with
e = p expanded along dim 0 (the op broadcasts the other dimensions, and autograd sums them, as it does for p).
So during its module's forward, each needed bare parameter is seen as a tensor subclass (:class:`Followed`)
whose ``__torch_function__`` follows it through the ops on it alone (slicing, reshapes, interpolation,
arithmetic with constants: the result is followed too) to the op that broadcasts it over the batch. There the
followed operand is first expanded to the batch along dim 0, and a hook on that view takes the per-example
gradient; one made from p by other ops is mapped back to p by one batched vjp (``torch.autograd.grad`` with
``is_grads_batched``). All uses of p in one step (several broadcasts, several calls of the module) add up as
per-example gradients, (B, *p.shape) in float32 held until the step's last one arrives, and the norm is
that of the sum.

p used as a layer's weight with an input whose dim 0 is the batch (``x @ p``, ``F.linear(x, p)``, a
convolution with p as its weight, an einsum whose batch letter leads the output: Funnel's
``einsum("binh,dnh->bind", q, r_kernel)``) is taken per example by the vjp of that op on each example's
input (vmap; B per-example gradients of p, chunked). So are the children's parameters that the module reads
without calling the child (Mamba's mixer hands ``self.conv1d.weight`` to F.conv1d itself): lent to the
module's forward as followed tensors while no child runs, and recorded in the child's slot. Any other use
of p together with a batched tensor (a tensordot, an in-place op on p) is not a broadcast, and this rule
cannot take its per-example gradient: the readers raise (``strict``) naming the parameter and the op, or
leave it out with a warning. Under ``torch.compile`` the
module's own forward runs eagerly, and its children, called from it, are compiled each on its own
(:mod:`.eager_parent`: a timm ViT's blocks and head). :data:`ENABLED` off makes such parameters uncovered
again, and the layers below read their calls without the batch by their rules.

The same following serves a covered layer called without the batch whose rule allows it (``Rule.unbatched``:
nn.Embedding on HF's ``position_ids`` of shape (1, T), on ``arange(T)``, on T5's relative-position buckets;
the generic rule, BART's positional embedding): its output, whose dim 0 is not the batch, is followed from
the layer to its broadcast (:func:`unbatched`, :func:`follow_call`), and the per-example gradient of its
weight is the batched vjp of the layer at the per-example gradients of that broadcast, (B, *weight.shape) at
once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_flatten, tree_map

from elasticlab.gns import folds
from elasticlab.gns.capture import batch_of
from elasticlab.gns.layers import expand_plan, layer_uses, mha_children
from elasticlab.gns.layers.broadcast_taps import Rows, Step
from elasticlab.gns.layers.eager_parent import EagerParent, disable, in_compiled_region
from elasticlab.gns.registry import Rule, register_fallback
from elasticlab.gns.slot import recomputing

ENABLED = True

_EXPANDS = {torch.Tensor.expand, torch.Tensor.expand_as, torch.Tensor.broadcast_to, torch.broadcast_to}
_REPEATS = {torch.Tensor.repeat, torch.Tensor.tile, torch.tile}
_ELEMENTWISE = {
    torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
    torch.sub, torch.Tensor.sub, torch.Tensor.__sub__, torch.Tensor.__rsub__,
    torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__,
    torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.__rtruediv__,
    torch.where, torch.lerp, torch.Tensor.lerp, torch.addcmul, torch.maximum, torch.minimum,
    torch.Tensor.__iadd__, torch.Tensor.add_, torch.Tensor.__isub__, torch.Tensor.sub_,
    torch.Tensor.__imul__, torch.Tensor.mul_,
}
_LAYER_OPS, _MATMULS = layer_uses.LAYER_OPS, layer_uses.MATMULS


class Followed(torch.Tensor):
    """A needed bare parameter, or a tensor made from such parameters alone, inside its module's forward;
    also a layer's output on an input without the batch. A root (``_root``: ("param", name) for the alias of
    a parameter, ("call", module, args, kwargs, need) for a layer's output) or made from ``_roots``."""
    _step: Step
    _root: tuple | None = None
    _roots: tuple = ()
    _live = True
    _pending: tuple = ()          # Rows it was expanded to, their layout not yet known
    _slice: tuple | None = None   # (a root, i) for root[i]: an expert's weight of (E, out, in)
    _transpose_of = None          # the root whose last two dimensions it transposes
    _plan = None                  # (a layer's output, watched for compile) its Step (.expand_plan)
    _uses = 0


def _follow(t, step: Step, live: bool, root: tuple | None = None, roots: tuple = (), pending: tuple = ()):
    if not (isinstance(t, torch.Tensor) and t.requires_grad):
        return t
    f = t.as_subclass(Followed)
    f._step, f._live, f._root, f._roots, f._pending = step, live, root, roots, pending
    return f


def _roots_of(fol: list) -> tuple:
    """The roots a tensor made from the followed tensors ``fol`` comes from, each once."""
    return tuple({id(r): r for f in fol for r in ((f,) if f._root is not None else f._roots)}.values())


def _attribute(func, args: tuple, kwargs: dict):          # .shape, .dtype, .T, .data of a followed tensor
    expand_plan.attribute(args[0], func)
    out = func(*args, **kwargs)
    return _follow(out, args[0]._step, args[0]._live, roots=_roots_of([args[0]]),
                   pending=args[0]._pending) if isinstance(out, torch.Tensor) else out


def _dispatch(func, args: tuple, kwargs: dict, flat: list, fol: list):
    others = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, Followed)]
    step, live, B = fol[0]._step, all(f._live for f in fol), fol[0]._step.batch
    roots, pending = _roots_of(fol), tuple(r for f in fol for r in f._pending)

    def swap(new: dict):
        return tree_map(lambda a: new.get(id(a), a), (args, kwargs))

    if func in _EXPANDS or func in _REPEATS:
        out = func(*args, **kwargs)
        f = args[0] if isinstance(args[0], Followed) else None
        if f is not None and B and _fills(f.shape, out.shape, B) and not pending:
            e = step.tap(f, live, out.dim())
            if func in _EXPANDS:
                expand_plan.tapped([f], out.dim())
            if func in _REPEATS:                       # the batch is made by the expand: repeat the rest
                return e.repeat(1, *(o // n for o, n in zip(out.shape[1:], e.shape[1:])))
            new_args, new_kwargs = swap({id(f): e})
            return func(*new_args, **new_kwargs)
        return tree_map(lambda t: _follow(t, step, live, roots=roots, pending=pending), out)
    inplace_on_param = func.__name__.endswith("_") or func.__name__.startswith("__i")
    shape = None
    if func in _ELEMENTWISE and B and not (inplace_on_param and isinstance(args[0], Followed)):
        shape = torch.broadcast_shapes(*(a.shape for a in flat if isinstance(a, torch.Tensor)))
        if (folded := _to_rows(step, fol, others, shape, live, swap, func)) is not None:
            return folded
    if not any(a.requires_grad or (B and a.dim() and a.shape[0] == B) for a in others):
        out = func(*args, **kwargs)                    # made from followed tensors (and constants) alone
        out = tree_map(lambda t: _follow(t, step, live, roots=roots, pending=pending), out)
        expand_plan.kept(func, fol, out)
        if isinstance(out, Followed) and (sl := layer_uses.slice_of(func, args)) is not None:
            out._slice = sl
        if isinstance(out, Followed) and (t := layer_uses.transpose_of(func, args)) is not None:
            out._transpose_of = t
        return out
    if func is F.multi_head_attention_forward and live and B and (out := mha_children.run(args, kwargs)):
        return out                                     # (WavLM: its children's weights, as their calls)
    if func is F.scaled_dot_product_attention and B:   # an additive mask (T5's position bias), broadcast
        q, mask = args[0], kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if isinstance(mask, Followed) and fol == [mask]:
            if pending and mask.dim() and mask.shape[0] == q.shape[0] and _resolve(pending, q, B):
                return func(*args, **kwargs)           # (its rows' taps take the gradient)
            if not pending and _fills(mask.shape, (q.shape[0],) * q.dim(), B):
                expand_plan.tapped([mask], q.dim())
                new_args, new_kwargs = swap({id(mask): step.tap(mask, live, q.dim())})
                return func(*new_args, **new_kwargs)
            if not pending and mask.dim() <= q.dim() and (fold := _rows_of(q, B)) is not None \
                    and _fills(mask.shape, (B,) * q.dim(), B):
                rows = Rows(q.shape[0], fold)         # (Swin's bias, (1, H, N, N), on (B·nW) windows)
                expand_plan.tapped([mask], q.dim(), rows)
                new_args, new_kwargs = swap({id(mask): step.tap(mask, live, q.dim(), rows)})
                return func(*new_args, **new_kwargs)
    if (func is F.linear or func in _MATMULS) and B and not pending \
            and (got := layer_uses.gathered_input(func, args, others, step.slot.owner._batch or B,
                                                  B != (step.slot.owner._batch or B))):
        return step.through(func, args, kwargs, fol, [got[0]], live, rows=got)
    model_b = step.slot.owner._batch or B
    if func in layer_uses.GROUPED and B and not pending and (got := layer_uses.grouped_input(
            func, args, kwargs, fol, others, model_b, B != model_b)):
        return step.grouped(func, args, kwargs, live, *got)
    if (func in _LAYER_OPS or func in _MATMULS) and B and not pending \
            and (batched := layer_uses.layer_inputs(func, args, fol, others, B)) is not None:
        return step.through(func, args, kwargs, fol, batched, live)
    step.cancel(fol)
    if shape is not None and all(_fills(f.shape, shape, B) for f in fol):
        expand_plan.tapped(fol, len(shape))
        new_args, new_kwargs = swap({id(f): step.tap(f, live, len(shape)) for f in fol})
        return func(*new_args, **new_kwargs)
    if live:
        for f in fol:
            step.refuse(f, func)
    return func(*args, **kwargs)


def _rows_of(t: torch.Tensor, batch: int):
    """The layout of ``t``'s rows where its dim 0 folds the batch with k > 1 windows or positions, read from
    its graph (:func:`elasticlab.gns.folds.find`), else None."""
    R = t.shape[0] if t.dim() else 0
    if R <= batch or R % batch or t.grad_fn is None or not folds.ENABLED:
        return None
    return folds.find(t, batch)


def _resolve(pending: tuple, t: torch.Tensor, batch: int) -> bool:
    """The layout of rows expanded earlier, read from the batched tensor ``t`` the result meets."""
    fold = _rows_of(t, batch)
    if fold is None or any(r.fold not in (None, fold) or r.cancelled for r in pending):
        return False
    for r in pending:
        r.fold = fold
        expand_plan.resolved(r)
    return True


def _to_rows(step: Step, fol: list, others: list, shape: tuple, live: bool, swap, func):
    """An elementwise op whose result has R = k·B rows (k > 1): with a batched tensor of R rows whose layout
    is found, the followed operands expanded to its rows (or their earlier expansion resolved); with
    constants of R rows alone (Swin's shifted-window mask), expanded with the layout left to be read where
    the result meets the batch. Else None."""
    B, R = step.batch, shape[0] if shape else 0
    if R <= B or R % B or not folds.ENABLED:
        return None
    batched = [a for a in others if a.requires_grad and a.dim() == len(shape) and a.shape[0] == R]
    if batched:
        fold = next((x for x in map(lambda a: _rows_of(a, B), batched) if x is not None), None)
        if fold is None:
            return None
        new = {}
        for f in fol:
            if f._pending and f.dim() == len(shape) and f.shape[0] == R:
                if not _resolve(f._pending, batched[0], B):
                    return None
            elif not f._pending and _fills(f.shape, (B,) * len(shape), B):
                new[id(f)] = (f, Rows(R, fold))
            else:
                return None
        for f, rows in new.values():
            expand_plan.tapped([f], len(shape), rows)
        new_args, new_kwargs = swap({i: step.tap(f, live, len(shape), rows) for i, (f, rows) in new.items()})
        return func(*new_args, **new_kwargs)
    if any(a.requires_grad for a in others) or not any(a.dim() == len(shape) and a.shape[0] == R
                                                        for a in others):
        return None
    if any(f._pending or not _fills(f.shape, (B,) * len(shape), B) for f in fol):
        return None
    rows = Rows(R)
    expand_plan.tapped(fol, len(shape), rows)
    new_args, new_kwargs = swap({id(f): step.tap(f, live, len(shape), rows) for f in fol})
    return _follow(func(*new_args, **new_kwargs), step, live, roots=_roots_of(fol), pending=(rows,))


def _fills(shape, out, batch: int) -> bool:
    """Whether a tensor of ``shape`` reaches the batch (dim 0 of the shape ``out``, of size ``batch``) by
    broadcasting: it has fewer dimensions, or a 1 first."""
    return bool(out) and out[0] == batch and (len(shape) < len(out) or shape[0] == 1)


def _torch_function(cls, func, types, args=(), kwargs=None):
    with torch._C.DisableTorchFunctionSubclass():
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "__get__":
            return _attribute(func, args, kwargs)
        flat, _ = tree_flatten((args, kwargs))
        fol = [a for a in flat if isinstance(a, Followed)]
        watched = expand_plan.begin(fol)
        try:
            return _dispatch(func, args, kwargs, flat, fol)
        finally:
            expand_plan.end(watched)


Followed.__torch_function__ = classmethod(_torch_function)


def applies(module: nn.Module) -> bool:
    """With :data:`ENABLED`, modules with children and parameters of their own, of no registered type (leaf
    modules take the generic rule), other than a parametrization's originals (which it transforms)."""
    return (ENABLED and next(module.children(), None) is not None
            and next(module.parameters(recurse=False), None) is not None
            and not isinstance(module, parametrize.ParametrizationList))


def own_params(module: nn.Module) -> tuple[str, ...]:
    """Its direct parameters, less aliases of its children's (Hugging Face's masked-LM head bias, which is
    its decoder's: counted there)."""
    below = {id(p) for c in module.children() for p in c.parameters()}
    return tuple(n for n, p in module.named_parameters(recurse=False) if id(p) not in below)


def broadcast_forward(module: nn.Module, slot):
    """The module's own forward with its needed bare parameters followed (eager, also under compile), and
    its children's, lent to it while none of them runs: a parent that reads a child's weight without
    calling the child (Mamba's mixer: F.conv1d on ``self.conv1d.weight``, ``self.dt_proj.weight @ …``) has
    that use taken per example too (:meth:`~elasticlab.gns.layers.broadcast_taps.Step.through`), recorded
    in the child's slot."""
    step, own = Step(slot), type(module).forward
    slot.follow = step
    kids = _children_slots(module, slot)
    lent: dict[int, dict] = {}          # id(child) -> {param: (itself, followed)} during the forward

    def restore(child, args):           # a child's own call sees its own parameters
        if (got := lent.get(id(child))) is not None:
            child._parameters.update({pn: p for pn, (p, _) in got.items()})

    def relend(child, args, output):
        if (got := lent.get(id(child))) is not None:
            child._parameters.update({pn: f for pn, (_, f) in got.items()})

    for c, _ in kids:
        slot.owner._handles += [c.register_forward_pre_hook(restore, prepend=True),
                                c.register_forward_hook(relend)]
    eager = EagerParent(module, slot.owner._handles, lambda a, kw: _carries_followed((a, kw)))

    @disable
    def forward(*args, **kwargs):
        with eager:
            out = followed(*args, **kwargs)
            if eager.callback is not None and _carries_followed(out):
                raise RuntimeError(        # (its compiled caller would trace the followed tensor: a crash)
                    f"module {slot.name!r} ({type(module).__name__}) returns {list(slot.need)} not yet "
                    "broadcast over the batch (a relative position bias, added to the attention scores "
                    "by its caller); under torch.compile the caller is compiled and cannot follow it to "
                    "that broadcast: run the model eagerly, or freeze these parameters")
            return out

    def followed(*args, **kwargs):
        live = slot.called()
        if not live and not (torch.is_grad_enabled() and recomputing()):
            return own(module, *args, **kwargs)        # no gradient comes of this call
        if live and slot.calls == 1:                   # (a recomputation follows too, with no hooks: the same
            b = batch_of(args, kwargs)                 # saved tensors as the forward's)
            step.batch = b if b is not None else slot.owner._batch   # (called on no tensor: the model's)
        saved = {}
        for pn in slot.need:
            p = module._parameters.get(pn)
            if p is not None and p.requires_grad:
                saved[pn] = p
                module._parameters[pn] = _follow(p, step, live, root=("param", pn))
        for c, cs in kids:
            got = {pn: (p, _follow(p, step, live, root=("child", cs, pn))) for pn in cs.need
                   if (p := c._parameters.get(pn)) is not None and p.requires_grad}
            if got:
                lent[id(c)] = got
                relend(c, (), None)
        try:
            return own(module, *args, **kwargs)
        finally:
            module._parameters.update(saved)
            for c, _ in kids:
                restore(c, ())
                lent.pop(id(c), None)
    return forward


def _carries_followed(tree) -> bool:
    """Whether a (nested) value holds a :class:`Followed` tensor, which compiled code cannot trace."""
    return any(isinstance(t, Followed) for t in tree_flatten(tree)[0])


def _children_slots(module: nn.Module, slot) -> list[tuple]:
    """(child, its slot) for the module's direct children that have a slot of their own (not one of a
    tied pair, nor a parametrization's)."""
    mine = {id(s.module): s for s in slot.owner._slots
            if s.host is s.module and not s.tied and not s.rule.on_owner and s is not slot}
    return [(c, mine[id(c)]) for c in module.children() if id(c) in mine]


def unbatched(slot, inputs: tuple, output) -> bool | tuple | None:
    """Whether a call of a layer whose rule allows it (``Rule.unbatched``: nn.Embedding, the generic rule) is
    one without the batch: its output's dim 0 is not the model's batch (an embedding of HF's
    ``position_ids`` (1, T), of ``arange(T)``, of T5's relative-position buckets (q, k); BART's positional
    embedding handed its positions by keyword). Its output is then followed to its broadcast
    (:func:`follow_call`) instead of its rule reading dim 0 as the examples; where the sizes coincide, the
    broadcast audit (:mod:`elasticlab.gns.broadcast`) still makes the readers raise. Followed eagerly only:
    under ``torch.compile`` (also in its eager parts, after a graph break) it is expanded as an eager step
    learned, or refused by name (None): :func:`.expand_plan.compiled`."""
    compiling = torch.compiler.is_compiling()
    if compiling and slot.seen_batched and not (slot.follow and slot.follow.expand):
        return False      # traced: batched, as an eager step saw it (reading the int B would specialise a
    B = slot.owner._batch                         # dynamic batch size: Dynamo guards on its value)
    if not ENABLED or B is None or not isinstance(output, torch.Tensor):
        return False
    if output.dim() and output.shape[0] == B:
        slot.seen_batched = slot.seen_batched or not compiling
        return False
    if slot.rule.rows and any(
            folds.fold_for(slot, t) is not None for t in (*inputs[:1], output)
            if isinstance(t, torch.Tensor)):
        return False                   # (a call on rows that fold the batch: its rule reads them so)
    if in_compiled_region():           # not followed (a traced flag, replayed; or eagerly after a graph
        return expand_plan.compiled(slot, inputs, output, B)   # break, then traced by compiled code: a crash)
    if slot.follow is None:
        slot.follow = Step(slot, layer=True)
    slot.follow.shape = tuple(output.shape)
    return True


def follow_call(slot, inputs: tuple, output, live: bool):
    """A layer's output on an input without the batch, followed: its parameters' per-example gradients are
    taken where the output is broadcast over the batch, mapped back through the layer by a batched vjp
    (``broadcast_taps._layer_vjp``, at the call's inputs, kept detached until then)."""
    step = slot.follow
    step.batch = slot.owner._batch
    kw = inputs[-1] if inputs and isinstance(inputs[-1], dict) else {}
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in (inputs[:-1] if kw else inputs))
    kw = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    root = _follow(output, step, live, root=("call", slot.module, args, kw, slot.need))
    expand_plan.watch(step, root)
    return root


register_fallback(Rule(norms=None, params=own_params, fused=broadcast_forward, sums_calls=True), applies)
