"""How per-example norms leave a compiled backward: as the gradient of a sink.

A backward that records its norms in the layer's slot (a Python side effect) cannot be traced by
``torch.compile``: Dynamo breaks the graph at each such layer and runs that layer eagerly. Instead, a
:class:`~elasticlab.gns.PerSampleGradNorms` keeps a *sink*, a (rows, capacity) leaf tensor with a row per
needed parameter of each layer, made eagerly before each forward of the model (:class:`Sinks`, sized from
the batch of the model's input). Under ``torch.compile`` a fused layer takes its (len(need), B) slice of it
as one more input (:func:`sink_for`) and its backward returns the norms as that input's gradient
(:func:`deliver`). AOTAutograd traces that like any gradient; after the compiled backward, the sink's
post-accumulate-grad hook records each layer's rows in its slot (:meth:`Sinks._take`), and ``sq_norms``
reads them in one reduction (:meth:`Sinks.read`). Layers served by hook rules get the same through
:class:`Tap`, an identity on the layer's output whose backward runs the rule. Eager calls keep recording
directly.
"""
from __future__ import annotations

import functools

import torch

from elasticlab.gns import kernels
from elasticlab.gns.capture import batched_input


def sink_for(slot, x: torch.Tensor) -> torch.Tensor | None:
    """Under ``torch.compile``, the (len(need), B) sink rows through which a fused layer's backward hands out
    its norms (:meth:`elasticlab.gns.slot.Slot.sink`; x's dim 0 is the batch), else None (eager: recorded in
    the slot)."""
    return slot.sink(x) if torch.compiler.is_compiling() else None


def deliver(ctx, norms: dict, batch: int) -> torch.Tensor | None:
    """A fused backward's norms: the gradient of its sink when the forward had one (``ctx.sink``, its dtype,
    else None): a row per parameter the slot needs, in ``slot.need``'s order, 0 for those this call has no
    norm of (several calls of one slot add up in the sink), None if it has none; else recorded in
    ``ctx.slot`` (None)."""
    if ctx.sink is None:
        if norms:                                          # (nothing to record where nothing trains)
            ctx.slot.record(norms, batch)
        return None
    rows = [norms.get(p) for p in ctx.slot.need]
    like = next((r for r in rows if r is not None), None)
    if like is None:                                   # no needed parameter trains in this call
        return None
    return torch.stack([(r if r is not None else torch.zeros_like(like)).to(ctx.sink) for r in rows])


class Tap(torch.autograd.Function):
    """Identity on a hooked layer's output; the backward runs a hook rule (``norms(module, inputs, grad,
    need)``, the slot's by default) on the output's gradient and the layer's inputs, and hands the norms to
    the sink (:func:`deliver`)."""

    @staticmethod
    def forward(ctx, out, sink, slot, module, norms, kinds, values, *tensors):
        ctx.slot, ctx.module, ctx.norms, ctx.sink = slot, module, norms, sink.dtype
        ctx.kinds, ctx.values, ctx.batch = kinds, values, out.shape[0]
        ctx.save_for_backward(*tensors)
        # not a view for autograd (traced only, so functionalized): an in-place op on the layer's output
        # (Falcon's ``mlp_output += attention_output``) is not refused as one on a custom Function's view
        return torch.ops.aten._unsafe_view(out, out.shape)

    @staticmethod
    def backward(ctx, g):
        tensors = iter(ctx.saved_tensors)
        inputs = tuple(next(tensors) if k else v for k, v in zip(ctx.kinds, ctx.values))
        norms = ctx.norms(ctx.module, inputs, g.detach(), ctx.slot.call_need)
        return (g, deliver(ctx, norms, ctx.batch), None, None, None, None, None,
                *([None] * len(ctx.saved_tensors)))


def tap(slot, module, inputs: tuple, output: torch.Tensor, norms=None) -> torch.Tensor | None:
    """Under ``torch.compile``, a hooked layer's output through :class:`Tap` (``norms``: the rule, else the
    slot's), or None where the sink does not fit the output's batch (dim 0) and device: the caller's tensor
    hook then records the norms."""
    sink = slot.sink(output)
    if sink is None:
        return None
    kinds = tuple(isinstance(i, torch.Tensor) for i in inputs)
    values = tuple(None if k else i for k, i in zip(kinds, inputs))
    tensors = [i.detach() for i in inputs if isinstance(i, torch.Tensor)]
    return Tap.apply(output, sink, slot, module, norms or slot.rule.norms, kinds, values, *tensors)


class Sinks:
    """The sink of one :class:`~elasticlab.gns.PerSampleGradNorms`: one (rows, capacity) leaf, a row per
    needed parameter of each slot (``slot.rows``), made before each forward of the model for its batch (dim 0
    of the call's first tensor argument with a dimension) and device: one comparison a step, the leaf remade
    only for a batch at least as wide (then twice the batch) or another input device. One
    post-accumulate-grad hook a step (:meth:`_take`) records each slot's rows that a traced forward used."""

    def __init__(self, slots: list):
        self.slots, self.capacity, self.device = slots, 0, None
        self.leaf: torch.Tensor | None = None
        self.last: tuple | None = None         # this step's (gradient, batch, slots recorded), for read()
        rows = 0
        for s in slots:
            s.rows, rows = (rows, rows + len(s.need)), rows + len(s.need)
        self.n_rows = rows

    def ready(self, args: tuple, kwargs: dict | None) -> None:
        self.last = None
        x = batched_input(args, kwargs)
        # wider than the batch, twice it when made: a traced slice of the batch's columns is never the whole
        # leaf (a comparison that would specialise a dynamic batch size), and a growing batch remakes it
        # (whose static shape a compiled graph guards on) only at each doubling
        if x is not None and (x.shape[0] >= self.capacity or x.device != self.device):
            self._make(2 * x.shape[0])
            self.capacity, self.device = 2 * x.shape[0], x.device

    def _make(self, batch: int) -> None:
        """The leaf, on the device of the slots' first trainable parameter, in the widest float type their
        norms come in (float32 for 16-bit parameters)."""
        params = [p for s in self.slots for p in s.module.parameters() if p.requires_grad]
        if not params:
            self.leaf = None
            return
        dtype = functools.reduce(torch.promote_types, {kernels.acc_dtype(p.dtype) for p in params})
        leaf = torch.zeros((self.n_rows, batch), dtype=dtype, device=params[0].device, requires_grad=True)
        leaf.register_post_accumulate_grad_hook(self._take)
        self.leaf = leaf

    def _take(self, leaf: torch.Tensor) -> None:
        """The sink's gradient, after the compiled backward: each slot whose rows a traced forward used
        records them, as views of one row split (no launch)."""
        g, leaf.grad = leaf.grad, None
        if g is None:
            return
        batches = {s._sink_batch for s in self.slots} - {0}
        batch = batches.pop() if len(batches) == 1 else None   # one batch size: the common case
        rows = None if batch is None else g[:, :batch].unbind(0)
        taken = 0
        for s in self.slots:
            b, (r0, r1) = s._sink_batch, s.rows
            if b:
                s._sink_batch = 0
                own = rows[r0:r1] if rows is not None else [g[r, :b] for r in range(r0, r1)]
                s.record(dict(zip(s.need, own)), b)
                taken += 1
        self.last = None if batch is None or not taken else (g, batch, taken)

    def read(self) -> torch.Tensor | None:
        """:meth:`~elasticlab.gns.PerSampleGradNorms.sq_norms` in one reduction over the sink's gradient
        (rows of slots that did not run are 0), when every slot holding norms this step took them from it
        (one batch size), without a loss scale; else None."""
        if self.last is None:
            return None
        g, b, taken = self.last
        if sum(1 for s in self.slots if s.norms) != taken:    # (a slot without a parameter records none)
            return None
        f = next(s for s in self.slots if s.norms).factor()
        total = g[:, :b].sum(0)
        return total * f if f != 1.0 else total
