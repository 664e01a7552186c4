"""The audit of layers whose output is broadcast over the batch, whose per-example norms cannot be taken.

A covered layer called on an input without the batch dimension (a positional embedding on ``arange(T)``, a
Linear on learned latents) and then broadcast over the batch receives its output's gradient summed over the
batch: its rule would read the T rows as T examples. Where T differs from the batch, the readers' sizes
disagree (an error); where T equals it, the norms come out wrong with no sign. So the first forward of each
input signature is audited: each covered layer notes its output's autograd node, and after the model ran the
graph is walked from the model's outputs. Each noted output is followed through the ops that keep its size
(views, elementwise ops) to the first op that makes it larger; if that op's result has the batch as dim 0
and the layer's output fills it by broadcasting (no such dimension, or a 1 there), the readers of the norms
raise a RuntimeError naming the layer, at that step and every later one of the same signature. The forward
itself runs on: a GNSMonitor with several backwards a step needs no per-example norms. Eager only (a compiled
graph hides the layers' nodes); a layer whose output leaves the model before its broadcast is not seen.
:data:`ENABLED` turns the audit off.
"""
from __future__ import annotations

import math

import torch

from elasticlab.gns import repeated
from elasticlab.gns.capture import batched_input
from elasticlab.gns.folds import grad_shapes
from elasticlab.gns.layers.common import by_position

_NONE = object()                 # (no argument given by position)

ENABLED = True
MAX_SIGNATURES = 32      # input signatures audited at most (then none: variable shapes cost a walk each)
MAX_HOPS = 8             # size-keeping ops followed from a layer's output


def _tensors(obj, depth: int = 0):
    """The tensors with an autograd node among a forward's outputs (two levels into tuples, lists and
    dicts, e.g. a model output object)."""
    if isinstance(obj, torch.Tensor):
        if obj.grad_fn is not None:
            yield obj
    elif depth < 2 and isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)


def signature(args: tuple, kwargs: dict | None) -> tuple:
    """The shapes of a forward's tensor arguments, positional then by keyword, one level into lists, tuples
    and dicts (where :func:`~elasticlab.gns.capture.batched_input` looks for the batch)."""
    def shapes(vals, depth):
        for k, v in vals:
            if isinstance(v, torch.Tensor):
                yield k, tuple(v.shape)
            elif depth < 1 and isinstance(v, (list, tuple, dict)):
                yield k, tuple(shapes(v.items() if isinstance(v, dict) else enumerate(v), depth + 1))
    return tuple(shapes((*enumerate(args), *(kwargs or {}).items()), 0))


def fills_batch(out: tuple, result: tuple, batch: int) -> bool:
    """Whether ``result`` has ``batch`` as dim 0 and a tensor of shape ``out`` broadcasts to it with that
    dimension made by the broadcast (missing from ``out``, or 1 there while the batch is larger)."""
    if not result or result[0] != batch or len(out) > len(result):
        return False
    if any(a != b and a != 1 for a, b in zip(reversed(out), reversed(result))):
        return False
    return len(result) > len(out) or (out[0] == 1 and batch > 1)


def _consumers(roots: list) -> tuple[dict[int, list], list]:
    """{id of an autograd node: the nodes that take its output}, over the graph below ``roots``; and the
    nodes walked (kept alive while ids are compared)."""
    parents: dict[int, list] = {}
    seen, alive, stack = set(), [], list(roots)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        alive.append(node)
        for child, _ in node.next_functions:
            if child is not None:
                parents.setdefault(id(child), []).append(node)
                stack.append(child)
    return parents, alive


def _broadcast_to(node, shape: tuple, parents: dict, batch: int) -> tuple | None:
    """The shape an op gave ``node``'s output (of ``shape``) when broadcasting it over the batch, following
    the ops that keep its size; None when none does."""
    frontier = [(node, shape, 0)]
    while frontier:
        n, s, hops = frontier.pop()
        for c in parents.get(id(n), ()):
            shapes = grad_shapes(c)                        # what the op hands back: its output's shape
            if shapes is None or len(shapes) != 1:
                continue
            result = shapes[0]
            if math.prod(result) == math.prod(s):
                if hops < MAX_HOPS:
                    frontier.append((c, result, hops + 1))
            elif math.prod(result) > math.prod(s) and fills_batch(s, result, batch):
                return result
    return None


class Audit:
    """The audit of one :class:`~elasticlab.gns.PerSampleGradNorms`. ``notes`` is None outside an audited
    forward (a layer checks it after ``is_compiling``), else {id of a layer's output node: (slot, node, input
    shape, output shape)}; ``error`` is this step's verdict (a RuntimeError naming the layer, which the
    readers raise, or None), kept per input signature in ``found``."""

    def __init__(self):
        self.found: dict[tuple, RuntimeError | None] = {}
        self.notes: dict | None = None
        self.error: RuntimeError | None = None
        self.batch, self.sig = 0, None

    def begin(self, args: tuple, kwargs: dict | None) -> None:
        """At the model's forward: this signature's verdict, or an audit if it is new (and gradients are
        on, and fewer than :data:`MAX_SIGNATURES` were audited)."""
        self.notes = self.error = None
        if not ENABLED or not torch.is_grad_enabled():
            return
        x = batched_input(args, kwargs)
        if x is None:
            return
        sig = signature(args, kwargs)
        if sig in self.found:
            self.error = self.found[sig]
        elif len(self.found) < MAX_SIGNATURES:
            self.notes, self.batch, self.sig = {}, x.shape[0], sig

    def note(self, slot, inputs, output) -> None:
        """A covered layer ran (eager): its output's node, with the shapes the error would name; not an
        output still followed to its broadcast (a bare parameter a module returns unbroadcast), whose
        per-example gradient is taken there (:mod:`elasticlab.gns.layers.broadcast_params`)."""
        from elasticlab.gns.layers.broadcast_params import Followed  # (it imports the registry's users)
        out = next(_tensors(output), None)
        if out is not None and not isinstance(out, Followed):
            x = next((i for i in inputs if isinstance(i, torch.Tensor)), None)
            shape_in = tuple(x.shape) if x is not None else ()
            self.notes[id(out.grad_fn)] = (slot, out.grad_fn, shape_in, tuple(out.shape))

    def wrap(self, slot, fwd):
        """A fused forward ``fwd`` that notes its output on audited forwards, and keeps its calls in the
        owner's first step (:func:`elasticlab.gns.repeated.watch`) (eager only; traced, it is ``fwd``, with
        no guard on ``notes``). One argument passed as it is where ``fwd`` takes one."""
        code, owner = getattr(fwd, "__code__", None), slot.owner

        def called(*args, **kwargs):
            if kwargs:                    # by position where the module's own forward could take them so
                args, kwargs = by_position(slot.arg_names, args, kwargs)
            out = fwd(*args, **kwargs)
            if not torch.compiler.is_compiling():
                if self.notes is not None:
                    self.note(slot, args, out)
                if owner._watch:
                    repeated.watch(slot, args, out)
            return out
        if code is None or code.co_argcount != 1 or code.co_flags & 0x0C:   # (*args or **kwargs)
            return called

        def forward(x=_NONE, **kwargs):
            if kwargs or x is _NONE:      # lin(input=x); lin() raises as the module's own forward would
                return called(*(() if x is _NONE else (x,)), **kwargs)
            out = fwd(x)
            if not torch.compiler.is_compiling():
                if self.notes is not None:
                    self.note(slot, (x,), out)
                if owner._watch:
                    repeated.watch(slot, (x,), out)
            return out
        return forward

    def end(self, output) -> None:
        """After an audited forward: its verdict, for this step and the signature's later ones."""
        notes, self.notes = self.notes, None
        if notes is not None:
            self.found[self.sig] = self.error = _verdict(notes, output, self.batch)


def _verdict(notes: dict, output, batch: int) -> RuntimeError | None:
    """A RuntimeError naming the first noted layer whose output an op broadcast over the batch, or None."""
    roots = [t.grad_fn for t in _tensors(output)]
    if not notes or not roots:
        return None
    parents, _alive = _consumers(roots)
    for slot, node, shape_in, shape in notes.values():
        result = _broadcast_to(node, shape, parents, batch)
        if result is not None:
            chance = (f" Its input's dim 0 has the batch's size by chance (as many positions as examples, "
                      f"{batch}): with another batch size it is followed as a broadcast and measured."
                      if shape_in and shape_in[0] == batch else "")
            return RuntimeError(
                f"module {slot.name!r} ({type(slot.module).__name__}) ran on an input of shape {shape_in} "
                f"and its output, of shape {shape}, is broadcast over the batch of {batch} (to {result}): it "
                "receives its gradient summed over the batch, from which no per-example norms can be taken "
                f"(its rule would read its {shape[0] if shape else 1} rows as examples). Give it the batch "
                "dimension: expand its input (for a positional embedding on arange(T): "
                "pos.unsqueeze(0).expand(B, -1); expanding its output does not help), or freeze its "
                "parameters (elasticlab.gns.broadcast.ENABLED = False turns this check off)." + chance)
    return None
