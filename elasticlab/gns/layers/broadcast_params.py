"""Bare parameters broadcast over the batch by a module with children: a Vision Transformer's class token and
position embedding (Dosovitskiy et al. 2021, eq. 1: z₀ = [x_class; x_p¹E; …; x_pᴺE] + E_pos; timm's
``cls_token`` / ``pos_embed``, Hugging Face's ``ViTEmbeddings``, torchvision's ``class_token`` /
``pos_embedding``), and learned queries or latents expanded over the batch.

Such a parameter p reaches the examples through a broadcast: ``p.expand(B, …)`` (or ``repeat``, ``tile``,
``broadcast_to``, ``expand_as``), an elementwise op with a batched tensor (``x + p``), or as the additive
``attn_mask`` of ``scaled_dot_product_attention``. Its per-example
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

Any other use of p together with a batched tensor (``x @ p``, a convolution with p as its weight, an in-place
op on p) is not a broadcast, and this rule cannot take its per-example gradient: the readers raise
(``strict``) naming the parameter and the op, or leave it out with a warning. Under ``torch.compile`` the
module's forward runs eagerly (with its children). :data:`ENABLED` off makes such parameters uncovered again,
and the layers below read their calls without the batch by their rules.

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

from elasticlab.gns import kernels
from elasticlab.gns.capture import batch_of
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


class Step:
    """One slot's per-example gradients of its followed parameters in the current step (``slot.follow``):
    its bare parameters, or, for a covered layer called without the batch, its own parameters."""

    def __init__(self, slot, layer: bool = False):
        self.slot, self.layer = slot, layer
        self.batch: int | None = None
        self.acc: dict[str, torch.Tensor] = {}        # {param: (B, *p.shape)} summed so far
        self.open = 0                                  # taps of the forward whose gradient has not come
        self.calls = 0                                 # (a layer) its calls without the batch this step
        self.shape: tuple = ()                         # (a layer) the output of its last such call

    def reset(self) -> None:
        """At each step's start (PerSampleGradNorms' forward pre-hook)."""
        self.batch, self.acc, self.open, self.calls = None, {}, 0, 0

    def refuse(self, f: Followed, func) -> None:
        """A use of followed parameters with batched or trainable tensors that is not a broadcast."""
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        for c_name, shown in (("_VariableFunctionsClass.", "torch."), ("TensorBase.", "Tensor."),
                              ("_TensorBase.", "Tensor.")):
            name = shown + name[len(c_name):] if name.startswith(c_name) else name
        slot = self.slot
        mod = f"{slot.name or '(root)'!r} ({type(slot.module).__name__})"
        how = (f"is used by {name} with tensors that carry the batch or train, and not as a broadcast over "
               "the batch (expand, repeat, an elementwise op), so the per-example gradient is not known")
        for pn in _names(f):
            slot.unmeasured.setdefault(pn, (
                f"module {mod} ran without the batch (its output has shape {self.shape}, the batch "
                f"{self.batch}), and that output {how}; expand its input over the batch, e.g. "
                "pos.unsqueeze(0).expand(B, -1)") if self.layer else
                f"bare parameter {slot.full(pn)!r} of module {mod} {how}")

    def tap(self, f: Followed, live: bool, ndim: int) -> torch.Tensor:
        """``f`` expanded to the batch along dim 0 (leading 1s put first where it has fewer dimensions than
        the op's result, of ``ndim``), its gradient taken per example by a hook."""
        B, shape = self.batch, tuple(f.shape)
        e = f.reshape((1,) * (ndim - len(shape)) + shape) if ndim > len(shape) else f
        e = e.expand(B, *e.shape[1:])
        if live and e.requires_grad:
            self.open += 1
            e.register_hook(lambda g: self._take(f, shape, g))
        return e

    def _take(self, f: Followed, shape: tuple, g: torch.Tensor) -> None:
        self.open -= 1
        B = g.shape[0]
        pe = g.detach().reshape(B, *shape)
        slot = self.slot
        if f._root is not None:
            at = [(f._root, pe)]
        else:                                          # made from its roots by other ops: their vjp, each
            with torch._C.DisableTorchFunctionSubclass(), torch.enable_grad():    # example's (no hook of a
                got = torch.autograd.grad(f, list(f._roots), pe, retain_graph=True,   # parameter runs: the
                                          allow_unused=True, is_grads_batched=True)  # roots are aliases)
            at = [(r._root, v) for r, v in zip(f._roots, got) if v is not None]
        per: dict[str, torch.Tensor] = {}
        for root, v in at:              # a parameter's alias: its own gradient; a layer's output: its vjp
            for pn, w in (_layer_vjp(root, v) if root[0] == "call" else {root[1]: v}).items():
                per[pn] = w if pn not in per else per[pn] + w
        last = self.open <= 0                          # the step's last use: nothing more to hold
        norms = {}
        for pn, v in per.items():
            v = v.to(kernels.acc_dtype(v.dtype))
            have = self.acc.pop(pn, None) if last else self.acc.get(pn)
            if have is not None and have.shape != v.shape:
                raise RuntimeError(f"bare parameter {slot.full(pn)!r} was broadcast over batches of sizes "
                                   f"{have.shape[0]} and {v.shape[0]} in one step: its per-example gradient "
                                   "needs every use to see the same examples along dim 0")
            total = v if have is None else have + v
            if not last:
                self.acc[pn] = total
            norms[pn] = kernels.row_sq(total)
        slot.record(norms, B)


class Followed(torch.Tensor):
    """A needed bare parameter, or a tensor made from such parameters alone, inside its module's forward;
    also a layer's output on an input without the batch. A root (``_root``: ("param", name) for the alias of
    a parameter, ("call", module, args, kwargs, need) for a layer's output) or made from ``_roots``."""
    _step: Step
    _root: tuple | None = None
    _roots: tuple = ()
    _live = True


def _follow(t, step: Step, live: bool, root: tuple | None = None, roots: tuple = ()):
    if not (isinstance(t, torch.Tensor) and t.requires_grad):
        return t
    f = t.as_subclass(Followed)
    f._step, f._live, f._root, f._roots = step, live, root, roots
    return f


def _names(f: Followed) -> list[str]:
    """The parameters a followed tensor comes from."""
    roots = (f,) if f._root is not None else f._roots
    return list(dict.fromkeys(pn for r in roots for pn in
                              ((r._root[1],) if r._root[0] == "param" else r._root[4])))


def _roots_of(fol: list) -> tuple:
    """The roots a tensor made from the followed tensors ``fol`` comes from, each once."""
    return tuple({id(r): r for f in fol for r in ((f,) if f._root is not None else f._roots)}.values())


def _layer_vjp(root: tuple, v: torch.Tensor) -> dict:
    """{param: (B, *shape)}: the vjp of a layer's call (``root``: ("call", module, args, kwargs, need)) at
    each example's cotangent of its output ``v`` (B, *output), by torch.func on the module's own forward at
    a detached copy of its parameters, so that no hook on them runs (GNSMonitor's, DDP's)."""
    from torch.func import functional_call, vjp, vmap

    from elasticlab.gns.slot import Quiet
    _, module, args, kwargs, need = root
    params = {pn: module.get_parameter(pn).detach() for pn in need}
    with torch.enable_grad(), Quiet():
        _, pull = vjp(lambda p: functional_call(module, p, args, kwargs, strict=False, tie_weights=False),
                      params)
        return vmap(pull)(v)[0]


def _dispatch(func, args: tuple, kwargs: dict):
    if getattr(func, "__name__", None) == "__get__":          # an attribute: .shape, .dtype, .T, .data
        out = func(*args, **kwargs)
        return _follow(out, args[0]._step, args[0]._live, roots=_roots_of([args[0]])) \
            if isinstance(out, torch.Tensor) else out
    flat, _ = tree_flatten((args, kwargs))
    fol = [a for a in flat if isinstance(a, Followed)]
    others = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, Followed)]
    step, live, B = fol[0]._step, all(f._live for f in fol), fol[0]._step.batch
    roots = _roots_of(fol)

    def swap(new: dict):
        return tree_map(lambda a: new.get(id(a), a), (args, kwargs))

    if func in _EXPANDS or func in _REPEATS:
        out = func(*args, **kwargs)
        f = args[0] if isinstance(args[0], Followed) else None
        if f is not None and B and _fills(f.shape, out.shape, B):
            e = step.tap(f, live, out.dim())
            if func in _REPEATS:                       # the batch is made by the expand: repeat the rest
                return e.repeat(1, *(o // n for o, n in zip(out.shape[1:], e.shape[1:])))
            new_args, new_kwargs = swap({id(f): e})
            return func(*new_args, **new_kwargs)
        return tree_map(lambda t: _follow(t, step, live, roots=roots), out)
    if not any(a.requires_grad or (B and a.dim() and a.shape[0] == B) for a in others):
        out = func(*args, **kwargs)                    # made from followed tensors (and constants) alone
        return tree_map(lambda t: _follow(t, step, live, roots=roots), out)
    inplace_on_param = func.__name__.endswith("_") or func.__name__.startswith("__i")
    if func in _ELEMENTWISE and B and not (inplace_on_param and isinstance(args[0], Followed)):
        shape = torch.broadcast_shapes(*(a.shape for a in flat if isinstance(a, torch.Tensor)))
        if all(_fills(f.shape, shape, B) for f in fol):
            new_args, new_kwargs = swap({id(f): step.tap(f, live, len(shape)) for f in fol})
            return func(*new_args, **new_kwargs)
    if func is F.scaled_dot_product_attention and B:   # an additive mask (T5's position bias), broadcast
        q, mask = args[0], kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if isinstance(mask, Followed) and fol == [mask] and _fills(mask.shape, (q.shape[0],) * q.dim(), B):
            new_args, new_kwargs = swap({id(mask): step.tap(mask, live, q.dim())})
            return func(*new_args, **new_kwargs)
    if live:
        for f in fol:
            step.refuse(f, func)
    return func(*args, **kwargs)


def _fills(shape, out, batch: int) -> bool:
    """Whether a tensor of ``shape`` reaches the batch (dim 0 of the shape ``out``, of size ``batch``) by
    broadcasting: it has fewer dimensions, or a 1 first."""
    return bool(out) and out[0] == batch and (len(shape) < len(out) or shape[0] == 1)


def _torch_function(cls, func, types, args=(), kwargs=None):
    with torch._C.DisableTorchFunctionSubclass():
        return _dispatch(func, args, kwargs or {})


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
    """The module's own forward with its needed bare parameters followed (eager, also under compile)."""
    step, own = Step(slot), type(module).forward
    slot.follow = step

    @torch.compiler.disable
    def forward(*args, **kwargs):
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
        try:
            return own(module, *args, **kwargs)
        finally:
            module._parameters.update(saved)
    return forward


def unbatched(slot, inputs: tuple, output) -> bool:
    """Whether a call of a layer whose rule allows it (``Rule.unbatched``: nn.Embedding, the generic rule) is
    one without the batch: its output's dim 0 is not the model's batch (an embedding of HF's
    ``position_ids`` (1, T), of ``arange(T)``, of T5's relative-position buckets (q, k); BART's positional
    embedding handed its positions by keyword). Its output is then followed to its broadcast
    (:func:`follow_call`) instead of its rule reading dim 0 as the examples; where the sizes coincide, the
    broadcast audit (:mod:`elasticlab.gns.broadcast`) still makes the readers raise. Eager only: under
    ``torch.compile`` such a call makes the readers raise naming the layer."""
    B = slot.owner._batch
    if not ENABLED or B is None or not isinstance(output, torch.Tensor):
        return False
    if output.dim() and output.shape[0] == B:
        return False
    if torch.compiler.is_compiling():          # not followed: the readers raise (a traced flag, replayed)
        for pn in slot.need:
            slot.unmeasured[pn] = (
                f"module {slot.name!r} ({type(slot.module).__name__}) ran without the batch (its output has "
                f"shape {tuple(output.shape)}, the batch {B}) under torch.compile, where such a call is not "
                "followed to its broadcast: run the model eagerly, or expand its input over the batch, e.g. "
                "pos.unsqueeze(0).expand(B, -1)")
        return False
    if slot.follow is None:
        slot.follow = Step(slot, layer=True)
    slot.follow.shape = tuple(output.shape)
    return True


def follow_call(slot, inputs: tuple, output, live: bool):
    """A layer's output on an input without the batch, followed: its parameters' per-example gradients are
    taken where the output is broadcast over the batch, mapped back through the layer by a batched vjp
    (:func:`_layer_vjp`, at the call's inputs, kept detached until then)."""
    step = slot.follow
    step.batch = slot.owner._batch
    kw = inputs[-1] if inputs and isinstance(inputs[-1], dict) else {}
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in (inputs[:-1] if kw else inputs))
    kw = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return _follow(output, step, live, root=("call", slot.module, args, kw, slot.need))


register_fallback(Rule(norms=None, params=own_params, fused=broadcast_forward, sums_calls=True), applies)
