"""The forward hook of a slot on its hook rule (:class:`~elasticlab.gns.PerSampleGradNorms` installs it where
a layer has no fused form, or runs with ``fused=False``): at each call it counts the call, and registers on
the output a tensor hook that, in the backward, runs the rule on the call's inputs (kept by
:func:`~elasticlab.gns.capture.kept`) and the output's gradient. On the way: a rule's own evaluation of the
module is left out (:class:`~elasticlab.gns.slot.Quiet`); a call without the batch is followed to its
broadcast (:mod:`.layers.broadcast_params`); a recomputation packs what its forward did; under
``torch.compile`` the norms leave the backward through the sink (:mod:`.sink`); the broadcast audit notes
the output. A rule with ``kwargs`` also gets the call's keyword arguments, as a dict after its positional
ones (the generic rule: forwards that read tensors passed by keyword, Whisper's positional embedding).
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns import sharded
from elasticlab.gns.capture import kept, pack_again
from elasticlab.gns.folds import fold_for
from elasticlab.gns.layers.broadcast_params import follow_call, unbatched
from elasticlab.gns.layers.common import as_forward, by_position, forward_autocast
from elasticlab.gns.sink import tap
from elasticlab.gns.slot import Quiet, recomputing


def install(owner, slot):
    """The hook on ``slot``'s module (its handle). A tied slot's (:mod:`.tied`), a tensor-parallel one's
    (:func:`.sharded.tensor_parallel`) and one whose gradient is in parts (:data:`.sharded.PARTIAL`) run
    eagerly under ``torch.compile``: a graph break at the module, whose rules then record in the slot as in
    eager mode."""
    hook = forward_hook(owner, slot)
    # (a tensor-parallel layer's first: its output as the layer made it, before parallelize_module's hook
    # redistributes it, so that its gradient is the one the layer's weight gradient is made of)
    eager = slot.tied or slot.tp or slot.module in sharded.PARTIAL
    return slot.host.register_forward_hook(hook.eager if eager else hook, with_kwargs=True,
                                           prepend=bool(slot.tp))


def forward_hook(owner, slot):
    """The forward hook of ``slot``'s rule; its ``eager``: the same, skipped by TorchDynamo."""
    def hook(module, args, kwargs, output):
        if Quiet.depth:                   # a rule's own evaluation of the module (generic rule)
            return
        if torch.compiler.is_compiling() and (slot.shared or slot.rule.outputs and isinstance(output, (
                tuple, list))):           # (a graph break) a router's tuple, joined eagerly; a module an
            return hook.eager(module, args, kwargs, output)   # eager step found repeated, its calls kept
        if kwargs:                        # lin(input=x): by position, as the rules read a call's inputs
            args, kwargs = by_position(slot.arg_names, args, kwargs)
        inputs = (*args, kwargs) if slot.rule.kwargs and kwargs else args
        unb = slot.rule.unbatched and unbatched(slot, inputs, output)   # (layers.broadcast_params)
        if unb is None:                   # refused under torch.compile: the readers raise, naming the call
            return
        if isinstance(unb, tuple):        # compiled, expanded over the batch as learned (layers.expand_plan)
            args, out, norms, fold = unb
            if norms is not None:         # (its output alone: the vjp of the call at each example's gradient)
                return expanded_call(slot, module, inputs, out, norms, fold)
            new = hook(module, args, kwargs, out)
            return out if new is None else new
        counted = slot.called(unb)
        if slot.rule.outputs and isinstance(output, (tuple, list)) and Join.takes(output):
            if counted:
                return Join.hooked(slot, module, inputs, output)
            if recomputing():
                pack_again(inputs)
            return
        if not (isinstance(output, torch.Tensor) and output.requires_grad):
            return
        if unb:
            return follow_call(slot, inputs, output, counted)
        compiling = torch.compiler.is_compiling()
        if not counted:                   # a recomputation packs what its forward did (capture.kept)
            if not compiling and recomputing():
                pack_again(inputs)
            return
        # compiled: the norms leave the backward as a gradient (elasticlab.gns.sink); rows that fold the
        # batch, by the layout an eager step found: unfolded (a row-wise rule), or to the tensor hook below
        fold = fold_of_call(slot, inputs, output) if compiling else None
        if fold is not None and slot.rule.folds:
            if (t := tap(slot, module, *fold.unfold_call(inputs, output))) is not None:
                return fold.refold(t)
        elif compiling and fold is None and (t := tap(slot, module, inputs, output)) is not None:
            return t
        if not compiling and owner._audit.notes is not None:
            owner._audit.note(slot, inputs, output)
        first = inputs[0] if inputs else None
        if not (isinstance(first, torch.Tensor) or slot.rule.kwargs and isinstance(first, dict)):
            raise ValueError(f"module {slot.name!r}: expected a tensor input")
        fresh = None
        if not compiling and output._is_view() and isinstance(module, nn.Linear):
            # a sequence Linear's output is a view of F.linear's 2-D product, which nothing else sees: an
            # in-place op on it (or on a view of it) would move its history past this hook, so the hook goes
            # on a tensor of its own (the same storage), returned in its place
            output = fresh = torch.ops.aten._unsafe_view(output, output.shape)

        output.register_hook(on_grad(slot, module, inputs, output))
        return fresh
    hook.eager = torch.compiler.disable(hook)
    return hook


def expanded_call(slot, module, inputs: tuple, output, norms, fold=None):
    """A batch-less call's output expanded over the batch (:mod:`.layers.expand_plan`), its norms by
    ``norms`` from the call's inputs and the expansion's gradient: through the sink where traced, else
    recorded by a tensor hook (compile's eager parts). With ``fold``, then repeated to the rows that fold the
    batch with windows, so that each example's gradient is the sum over its rows."""
    if not slot.called() or not output.requires_grad:
        return output if fold is None else _to_rows(output, fold)
    t = tap(slot, module, inputs, output, norms) if torch.compiler.is_compiling() else None
    if t is None:
        saved = tuple(i.detach() if isinstance(i, torch.Tensor) else i for i in inputs)
        t = output.view_as(output)
        t.register_hook(lambda g: slot.record(norms(module, saved, g.detach(), slot.call_need), g.shape[0]))
    return t if fold is None else _to_rows(t, fold)


def _to_rows(t, fold):
    """(B, …) repeated to the (B·per, …) rows of ``fold``: example b's tensor on each of its rows."""
    return fold.refold(t.unsqueeze(1).expand(t.shape[0], fold.per, *t.shape[1:]))


def fold_of_call(slot, inputs: tuple, output):
    """The layout of a call's rows that fold the batch (under torch.compile, as an eager step found it), for
    a rule that reads them (``Rule.folds``: its input; ``Rule.rows``: its input or, a router on (B, T, D)
    giving (B·T, E) logits, its output), else None."""
    if not (slot.rule.folds or slot.rule.rows):
        return None
    fold = fold_for(slot, inputs[0] if inputs else None)
    return fold_for(slot, output) if fold is None and slot.rule.rows and output is not None else fold


def on_grad(slot, module, inputs, output=None):
    """The tensor hook of one call: its rule on the kept inputs and the output's gradient (a tuple of them,
    :class:`Join`). Rows that fold the batch ((B·T, …)) are read unfolded to (B, T, …) for a row-wise rule
    (``Rule.folds``), or handed with their layout to a rule that reads them so (``Rule.rows``)."""
    get = kept(inputs)
    first = inputs[0] if inputs else None
    state = None                            # (the autocast state a rule that runs the forward again needs)
    if slot.rule.reruns:
        state = forward_autocast(first if isinstance(first, torch.Tensor) else output)
    fold = fold_of_call(slot, inputs, output)

    def run(g):
        saved = get()
        if slot.tp:                         # this process's shards (gns.sharded.reduce_norms sums them)
            saved, g = sharded.local_call(slot, saved, g)
        if fold is not None and slot.rule.folds:
            saved, g = fold.unfold_call(saved, g)
        g = tuple(None if t is None else t.detach() for t in g) if isinstance(g, tuple) else g.detach()
        if slot.shared:                     # formed with its other calls when read
            if isinstance(g, tuple) or (fold is not None and slot.rule.rows):
                for pn in slot.call_need:
                    slot.unmeasured.setdefault(pn, (
                        f"module {slot.name!r} ({type(module).__name__}) is called more than once in a "
                        "forward, on rows that fold the batch or with a tuple output, which its calls' sum "
                        "does not take yet"))
                return
            slot.pending.append((saved, g) if state is None else (saved, g, state))
            return
        with as_forward(state):             # (a rule that runs the forward again runs it as it ran)
            if fold is not None and slot.rule.rows:
                norms, B = slot.rule.norms(module, saved, g, slot.call_need, fold=fold), fold.batch
            else:
                norms = slot.rule.norms(module, saved, g, slot.call_need)
                B = saved[0].shape[0] if isinstance(saved[0], torch.Tensor) else _first(g).shape[0]
        slot.record(norms, B)
    return run


def _first(g):
    return next(t for t in g if t is not None) if isinstance(g, tuple) else g


class Join(torch.autograd.Function):
    """The tensors of a tuple output that carry a gradient, passed on as copies, so that the backward hands
    all their gradients to one callback (``Rule.outputs``; zeros for an output the loss did not reach)."""

    @staticmethod
    def forward(ctx, run, *tensors):
        ctx.run = run
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.run(grads)
        return (None, *grads)

    @staticmethod
    def takes(output) -> bool:
        return not torch.compiler.is_compiling() and any(
            isinstance(o, torch.Tensor) and o.requires_grad for o in output)

    @staticmethod
    def hooked(slot, module, inputs, output):
        """``output`` with its gradient-carrying tensors joined: the rule gets a tuple of the output's
        gradients, None where an output carries none (integer indices)."""
        at = [i for i, o in enumerate(output) if isinstance(o, torch.Tensor) and o.requires_grad]
        run = on_grad(slot, module, inputs, output[at[0]])

        def spread(grads):
            got = dict(zip(at, grads))
            run(tuple(got.get(i) for i in range(len(output))))
        joined = Join.apply(spread, *(output[i] for i in at))
        new = list(output)
        for i, t in zip(at, joined):
            new[i] = t
        if isinstance(output, list) or type(output) is tuple:
            return type(output)(new)
        return type(output)(*new)                                   # (a namedtuple)
