"""A batch-less layer call under ``torch.compile``, expanded over the batch as an eager step saw it used.

Eagerly, an nn.Embedding called without the batch (Hugging Face's ``position_ids`` (1, T), ``arange(T)``) is
followed to where its output meets the batch (:mod:`.broadcast_params`); compiled code cannot trace that
subclass. What the following saw is kept in the layer's :class:`~.broadcast_taps.Step` (``expand``) for the
steps after it: whether each call's output went, through ops that keep its shape and values alone
(``.to``, ``.type_as``, ``.contiguous``, ``.clone``), to exactly one use, an elementwise op that broadcasts
it over the batch along dim 0 (``inputs_embeds + position_embeds``, ``embeddings += position_embeddings``)
or an ``expand`` to the batch. Such an output enters the examples only by that broadcast, so replacing
e = E[idx] by its expansion over the batch, E[idx] for each example b, changes no value downstream, and
∇E ℓ_b is then the embedding rule on the expanded index, ``idx.expand(B, …)`` (eq. of
:mod:`.embedding`). Under compile (and in its eager parts), a call whose outputs an eager step saw only so
used is run that way (:func:`expanded`); any other use seen (an index, a reduction, ``.shape``, a second
use, dropout, which would draw a mask per example) rules it out for good, and the readers still raise
naming the layer, as they do before any eager step.

A call that is not such a lookup of its first argument (BART's and Whisper's positional embeddings, whose
own forwards make the positions; a generic leaf module on ``arange(T)``) has its output alone expanded, and
its norms are those of the vjp of its one forward at each example's gradient of the expansion,
∇θ ℓ_b = J_θ f(θ, x)ᵀ δ_b (:func:`output_norms`: the batched vjp the eager step takes at the broadcast),
B per-example gradients of its parameters at once, chunked as the generic rule's are.

An output the eager step saw meet the batch on rows that fold it with windows (Swin's relative position
bias, (1, H, N, N), added to the (B·nW, H, N, N) scores, alone or through the shifted windows' mask) is
kept with that layout, (rows per example, batch-major) and the model input's shape past the batch, which
the windows come from. Under compile, at that input shape, its expansion over the batch is repeated to
each example's rows (:func:`elasticlab.gns.hooks.expanded_call`), so that the gradient reaching the
expansion is each example's summed over its rows, as the eager tap sums them; at another input shape the
call is refused by name.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.func import vjp, vmap
from torch.nn.utils.stateless import _reparametrize_module

from elasticlab.gns import kernels
from elasticlab.gns.folds import Fold

# ops on the followed output alone that keep its shape and values: the expansion commutes with them
KEEPS = {torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.contiguous, torch.Tensor.clone,
         torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.type}
ATTRIBUTES = {"dtype", "device", "requires_grad", "is_cuda", "layout", "is_leaf", "grad_fn"}
SPOILED = False

_OK: list[set] = []        # per op on a followed call's output: the ids its branch cleared (a stack)


def applies(slot) -> bool:
    """A layer whose rule reads a call without the batch (``Rule.unbatched``) with no children, whose forward
    can be run again in the backward with no hook inside it: its output can be expanded (:func:`expanded`)."""
    return slot.rule.unbatched and next(slot.module.children(), None) is None


def _is_lookup(slot) -> bool:
    """An nn.Embedding (or a subclass that scales its lookup) with its rule: the expansion is a lookup on the
    expanded index."""
    return isinstance(slot.module, nn.Embedding) and slot.rule.params == ("weight",)


def watch(step, root) -> None:
    """A call's output (``root``, a Followed) to be watched for :func:`expanded`."""
    if applies(step.slot):
        root._plan = step


def attribute(f, func) -> None:
    """An attribute read on a watched tensor: only its dtype, device and flags keep it expandable."""
    if getattr(f, "_plan", None) is not None and getattr(getattr(func, "__self__", None), "__name__",
                                                         None) not in ATTRIBUTES:
        f._plan.expand = SPOILED


def begin(fol: list) -> list:
    """Before an op on followed tensors: the watched ones among them, each use counted."""
    mine = [f for f in fol if getattr(f, "_plan", None) is not None]
    for f in mine:
        f._uses += 1
    _OK.append(set())
    return mine


def tapped(fol: list, ndim: int, rows=None) -> None:
    """The op's branch expanded ``fol`` over the batch (dim 0 of a result of ``ndim`` dimensions), or with
    ``rows`` (a :class:`~.broadcast_taps.Rows`) to the R rows that fold it with windows: for a watched tensor
    used here first, that is the plan, (its dimensions, the leading ones the op adds), and for rows their
    layout, once known (:func:`resolved`)."""
    for f in fol:
        if getattr(f, "_plan", None) is not None and f._uses == 1:
            _OK[-1].add(id(f))
            if rows is None:
                learn(f._plan, (f.dim(), ndim - f.dim()))
            else:
                rows.plans.append((f._plan, (f.dim(), ndim - f.dim())))
                if rows.fold is not None:
                    resolved(rows)


def resolved(rows) -> None:
    """The layout of rows a watched output was expanded to is known, or never will be (cancelled: the result
    went on to another use; or it never met the batch): the plan (dims, leading dims added, rows per
    example, batch-major, the model input's shape past the batch, which the windows come from), or none."""
    for step, (dims, lead) in rows.plans:
        if rows.cancelled or rows.fold is None:
            step.expand = SPOILED
        else:
            shape = step.slot.owner._input_shape
            learn(step, (dims, lead, rows.fold.per, rows.fold.major, shape and shape[1:]))
    rows.plans = []


def kept(func, fol: list, out) -> None:
    """The op made ``out`` from ``fol`` alone: watched on, where it is one watched tensor with its shape."""
    if len(fol) == 1 and func in KEEPS and getattr(fol[0], "_plan", None) is not None and fol[0]._uses == 1 \
            and isinstance(out, torch.Tensor) and getattr(out, "_step", None) is not None \
            and out.shape == fol[0].shape:
        _OK[-1].add(id(fol[0]))
        out._plan, out._uses = fol[0]._plan, 0


def end(mine: list) -> None:
    """After the op: a watched tensor it did not clear (any other use) rules the expansion out."""
    ok = _OK.pop()
    for f in mine:
        if id(f) not in ok:
            f._plan.expand = SPOILED


def learn(step, plan: tuple) -> None:
    if step.expand is None:
        step.expand = plan
    elif step.expand != plan:          # (SPOILED stays; two calls used otherwise: neither)
        step.expand = SPOILED


def advice(slot) -> str:
    """What lifts a compiled call's refusal: an eager step first, unless one already saw another use."""
    if not applies(slot):
        return ("its module has children, whose calls would run inside its forward again, so its output is "
                "not expanded under compile: run the model eagerly")
    if slot.shared and slot.follow is not None and slot.follow.expand:
        return ("it is called more than once in a forward and is not a lookup of its first argument, so its "
                "calls are not expanded under compile: run the model eagerly")
    plan = None if slot.follow is None else slot.follow.expand
    if plan and len(plan) > 2:
        tail = ", ".join(map(str, plan[4] or ()))
        return (f"an eager step learned the rows that fold the batch with windows, which its output is "
                f"repeated to, for inputs of shape (B, {tail}), and this one is {slot.owner._input_shape}: "
                "run one step eagerly at this shape first")
    if slot.follow is not None and slot.follow.expand is SPOILED:
        return ("an eager step saw its output used otherwise than by one broadcast over the batch (permuted, "
                "indexed, reduced, used twice), so it is not expanded under compile: run the model eagerly")
    return ("run one step eagerly first (PerSampleGradNorms' eager_first=True, the default, or a step of "
            "the model itself, not compiled), from which an output only broadcast over the batch is learned "
            "and then expanded under compile")


def _split(inputs: tuple) -> tuple[tuple, dict]:
    """A hook's inputs as (positional arguments, keyword arguments: a rule with ``kwargs`` gets them as a
    dict after the others)."""
    return (inputs[:-1], inputs[-1]) if inputs and isinstance(inputs[-1], dict) else (inputs, {})


def compiled(slot, inputs: tuple, output: torch.Tensor, batch: int):
    """A batch-less call under torch.compile: :func:`expanded`, or None with the readers made to raise naming
    the layer (its rule does not read the call either)."""
    if (got := expanded(slot, inputs, output, batch)) is not None:
        return got
    for pn in slot.need:
        slot.unmeasured[pn] = (
            f"module {slot.name!r} ({type(slot.module).__name__}) ran without the batch (its output has "
            f"shape {tuple(output.shape)}, the batch {batch}) under torch.compile, where such a call is not "
            f"followed to its broadcast: {advice(slot)}, or expand its input over the batch, e.g. "
            "pos.unsqueeze(0).expand(B, -1)")
    return None


def expanded(slot, inputs: tuple, output: torch.Tensor, batch: int):
    """(args, output, norms, fold) of a batch-less call expanded over the batch as learned, or None: not
    learned, ruled out, or a call of another shape than the one learned from. ``inputs``: the hook's (a rule
    with ``kwargs`` gets them as a dict after the others). A lookup of its first argument gets that index
    expanded too, and ``norms`` None (its rule reads the expanded call); any other call keeps its
    arguments, ``norms`` then :func:`output_norms` (not for a module called several times in a forward,
    whose calls' per-example gradients would have to be summed before the norm). ``fold``: the layout of
    the rows that fold the batch the expansion is then repeated to, else None."""
    args, kwargs = _split(inputs)
    step = slot.follow
    plan = None if step is None else step.expand
    if not plan or not applies(slot):
        return None
    dims, lead, *rows = plan
    if output.dim() != dims or (lead == 0 and output.shape[0] != 1):
        return None
    out = output.reshape((1,) * lead + tuple(output.shape))
    out = out.expand(batch, *out.shape[1:])
    if rows:                            # (to the rows that fold the batch, for the same model input shape)
        per, major, tail = rows
        shape = slot.owner._input_shape
        if slot.shared or shape is None or shape[1:] != tail:
            return None
        return args, out, output_norms, Fold(batch, per, major)
    idx = args[0] if args else None
    if _is_lookup(slot) and isinstance(idx, torch.Tensor) and tuple(idx.shape) == tuple(output.shape[:-1]) \
            and not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        idx = idx.reshape((1,) * lead + tuple(idx.shape))
        return (idx.expand(batch, *idx.shape[1:]), *args[1:]), out, None, None
    return None if slot.shared else (args, out, output_norms, None)


def output_norms(module: nn.Module, inputs: tuple, d: torch.Tensor, need) -> dict:
    """‖∇θ ℓ_b‖² of each needed parameter for a batch-less call whose output was expanded over the batch:
    ∇θ ℓ_b = J_θ f(θ, x)ᵀ δ_b, the vjp of the call's one forward (its class's own, so that no hook runs: it
    may be traced) at example b's gradient δ_b of the expansion (d, (B, …)), by vmap in chunks."""
    from elasticlab.gns.layers.generic import chunk_size
    args, kwargs = _split(inputs)
    params = {pn: module.get_parameter(pn).detach() for pn in need}

    def forward(p):
        with _reparametrize_module(module, p, tie_weights=False, strict=False):
            return type(module).forward(module, *args, **kwargs)

    B = d.shape[0]
    with torch.enable_grad():
        out, pull = vjp(forward, params)
        per = vmap(lambda v: pull(v.reshape(out.shape).to(out.dtype))[0],
                   chunk_size=chunk_size(B, params.values()))(d)
    return {pn: kernels.row_sq(v.reshape(B, -1).to(kernels.acc_dtype(v.dtype))) for pn, v in per.items()}
