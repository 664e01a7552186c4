"""A module called several times in one forward of the model: a layer applied at each step of a hand-written
recurrent loop (an ``nn.Linear`` over time), one block shared across depth (ALBERT, Lan et al. 2020;
universal transformers), one encoder applied to both views inside a siamese model's forward.

Its parameters' per-example gradient is the sum over its K calls, G_b = Σ_k G_{b,k}, whose squared norm has
cross terms between the calls, ‖G_b‖² = Σ_{k,l} ⟨G_{b,k}, G_{b,l}⟩, so per-call norms cannot be added up.
Once a module is seen called twice in a step (it is then *repeated* for good), its hook rule keeps each call's
inputs and output gradient until the norms are read (:func:`settle`), then forms them together:

- a rule with a ``summed`` form (:mod:`elasticlab.gns.registry`) takes all calls at once. For the layers
  whose per-example gradient is a sum over positions (Linear, Embedding, LayerNorm, RMSNorm) that is one
  call on the calls concatenated along the positions, exact by linearity: [δ_1; δ_2]ᵀ[a_1; a_2] = Σ_k δ_kᵀa_k.
  The fused backwards of the recurrent cells and of nn.MultiheadAttention keep their calls' Linear parts
  themselves, summed alike (:func:`elasticlab.gns.layers.linear.summed_parts`), exact from the first step;
- any other hook rule (Conv, GroupNorm, the generic rule): each call's per-example vjp by torch.func, summed
  per example before the norm (:func:`elasticlab.gns.layers.generic.summed_norms`; B per-example gradients
  of the module's parameters, chunked).

A fused layer's backward takes one call at a time, so a fused module found repeated moves to hooks at the
next step (:func:`to_hooks`). In the first step every fused call's input and output gradient are kept too
(:func:`watch`), so a module found repeated there is exact from the first step; one found repeated only in
a later step gives NaN for that step, which the estimators skip and count, and warns once; so does a step
where one call's gradient was consumed alone before the next call ran (reentrant activation checkpointing
around each call: later steps keep every call). Calls whose outputs the loss does not reach add nothing, as
their gradient is zero. Under ``torch.compile``, a module an eager step found repeated has its hook run
eagerly (a graph break at each call), its calls kept as above. Refused (an error naming the module): a
module first found repeated under ``torch.compile``, one whose rule has only a fused form and no summed one
(nn.LSTM and its kin, nn.EmbeddingBag), one in a tied pair, and calls on batches of different sizes.
"""
from __future__ import annotations

import warnings

import torch

from elasticlab.gns.folds import fold_for

_COMPILED = ("the per-example norms of a module called several times are formed eagerly, from every call's "
             "gradient: run one step eagerly first (eager_first=True, the default, or a step of the model "
             "itself, not compiled), after which such a module's calls are kept eagerly under compile, or "
             "run the model eagerly")


def again(slot) -> None:
    """At a module's second (or later) counted call in a step: marks it repeated, or raises where that is
    not supported; a call already taken alone (a fused form, or a gradient consumed) spoils the step."""
    what = (f"module {slot.name or '(root)'!r} ({type(slot.module).__name__}) ran {slot.calls} times in one "
            "forward")
    # traced: its first call was (Dynamo runs eagerly the frame whose trace raised); sticky once refused
    if slot.traced or torch.compiler.is_compiling() or slot.refused:
        slot.refused = True
        raise RuntimeError(f"{what} under torch.compile: {_COMPILED}")
    f = slot.follow
    if slot.rule.sums_calls or f is not None and f.calls == slot.calls:    # (all its calls followed)
        return
    if f is not None and f.calls:
        raise RuntimeError(f"{what}, on inputs with and without the batch: a call without it is followed "
                           "to its broadcast, one with it read by its rule, and the two cannot be summed; "
                           "expand the batch-less input over the batch")
    if slot.rule.norms is None and slot.rule.summed is None:
        raise RuntimeError(f"{what}: its rule has only a fused form, which takes one call at a time, so the "
                           "norm of the gradient summed over the calls cannot be formed; call it once per "
                           "forward, or freeze it")
    if slot.tied:
        raise RuntimeError(f"{what}, and its weight is tied to another module's: that pair's rule takes one "
                           "call of each; call it once per forward, or untie the weights")
    slot.owner._repeated = True
    slot.shared = True
    if slot.fused and slot.rule.norms is not None:     # (a fused-only rule's summed form keeps its calls)
        if not slot.owner._watch:                      # (the first step's calls are kept: :func:`watch`)
            slot.spoiled = "its fused backward takes one call at a time; it runs on hooks from the next step"
        slot.owner._unfuse.add(slot.index)
    elif slot.norms:
        slot.spoiled = ("an earlier call's gradient was taken alone before this call ran (reentrant "
                        "activation checkpointing around each call); later steps keep every call's gradient")


def watch(slot, args: tuple, out) -> None:
    """In the first step of a :class:`~elasticlab.gns.PerSampleGradNorms`: a hook on a fused call's output
    that keeps the call's inputs and output gradient where the module turned out repeated (its second call
    came in the same forward), so that its norms are those of all its calls from the first step; for a
    module called once, the hook returns at once. Later steps pay nothing: the modules found repeated run
    on hooks (:func:`to_hooks`); one found repeated only in a later step gives NaN for that step."""
    if slot.rule.norms is None or slot.tied or not (isinstance(out, torch.Tensor) and out.requires_grad) \
            or not args or not isinstance(args[0], torch.Tensor) \
            or torch._C._current_graph_task_id() != -1:       # (a recomputation in a backward: no call)
        return
    fold = fold_for(slot, args[0]) if slot.rule.folds else None
    box = [args]                        # (emptied after the forward unless the module turned out repeated:
    slot.watched.append(box)            # :func:`release`, so that no input is held longer than its graph)

    def keep(g):
        if box and slot.shared and not slot.spoiled:
            saved = box.pop()
            if fold is not None:
                saved, g = fold.unfold_call(saved, g)
            slot.pending.append((saved, g.detach()))
    out.register_hook(keep)


def release(slots) -> None:
    """After the watched forward: the inputs kept by :func:`watch` of the modules called once are let go."""
    for s in slots:
        if s.watched:
            if not s.shared:
                for box in s.watched:
                    box.clear()
            s.watched = []


def mixed(slot) -> None:
    """A call in a backward, outside a non-reentrant replay, of a module that ran in the forward: reentrant
    activation checkpointing recomputes a segment that calls it while it also ran outside one. That call
    is not counted (it cannot be told from a replay), so the readers raise (:func:`settle`)."""
    slot.mixed = True
    slot.owner._repeated = True


def settle(slots) -> None:
    """Before the norms are read: each repeated module's norms from all its calls of the step, or NaN for
    a spoiled step (with one warning per module). The fused modules found repeated get their own forward
    back first (:func:`to_hooks`): the torch.func form of a rule without a summed one runs it."""
    if slots and slots[0].owner._unfuse and slots[0].owner._active:   # (after __exit__: restored there)
        to_hooks(slots[0].owner)
    for s in slots:
        if s.mixed:
            raise RuntimeError(
                f"module {s.name or '(root)'!r} ({type(s.module).__name__}) ran in the forward and again "
                "inside a reentrant activation checkpoint's recomputation: a call inside a reentrant "
                "segment cannot be told from a replay of one made outside it, so its gradient would be "
                "missing from the norms. Checkpoint with use_reentrant=False, or keep the module's calls "
                "all inside or all outside the reentrant segments")
        if s.spoiled:
            _spoil(s)
        elif s.pending:
            calls, s.pending = s.pending, []
            # (a fused rule's parts, B; a call that runs the forward again also has its autocast state)
            sizes = [d if isinstance(d, int) else d.shape[0] for _, d, *_ in calls]
            if len(set(sizes)) != 1:
                raise RuntimeError(f"module {s.name or '(root)'!r} ({type(s.module).__name__}) ran on "
                                   f"batches of sizes {sizes} in one forward: per-example norms of a "
                                   "repeated module need every call to see the same examples along dim 0")
            if s.rule.summed is not None:
                norms = s.rule.summed(s.host, calls, s.call_need)
            else:
                from elasticlab.gns.layers.generic import summed_norms
                norms = summed_norms(s.module, calls, s.need, what=(
                    f"module {s.name!r} ran {len(calls)} times in one forward and its rule has no summed "
                    "form, so torch.func sums the calls' per-example gradients, but"))
            s.record(norms, sizes[0])


def _spoil(s) -> None:
    """NaN norms for the step (also over a fused slot's rows, which its calls' backwards overwrote in turn:
    a slot not on the block sends the readers to their general path)."""
    d = s.pending[0][1] if s.pending and isinstance(s.pending[0][1], torch.Tensor) else None
    batch = s.batch or (d.shape[0] if d is not None else s.pending[0][1] if s.pending else 0)
    device = d.device if d is not None else next(s.module.parameters()).device
    s.record({p: torch.full((batch,), float("nan"), device=device) for p in s.need}, batch)
    s.pending = []
    if not s.warned:
        s.warned = True
        warnings.warn(f"module {s.name or '(root)'!r} ({type(s.module).__name__}) ran {s.calls} times in one "
                      "forward: its per-example norms are those of the gradient summed over its calls. This "
                      f"step's are NaN for it (the estimators skip and count such steps): {s.spoiled}",
                      RuntimeWarning, stacklevel=4)


def to_hooks(owner) -> None:
    """At a step's start: the fused modules found repeated get their own forward back, and a hook rule."""
    from elasticlab.gns import hooks  # (hooks → slot → this module)
    for i in sorted(owner._unfuse):
        s = owner._slots[i]
        for j, (mod, old) in enumerate(owner._patched):
            if mod is s.module:
                if old is None:
                    del mod.forward
                else:
                    mod.forward = old
                del owner._patched[j]
                break
        owner._handles.append(hooks.install(owner, s))
        s.fused, s.buf, s._buf_key, s._views, s._in_block = False, None, None, {}, False
        block = owner._block
        if i in block.users:                   # its rows: 0 from now on (a NaN row would spoil every read)
            block.users.discard(i)
            block.tensor[i].zero_()
            block._mask, block._weights = None, {}
    owner._unfuse.clear()
    owner._bufs = None
