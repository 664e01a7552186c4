"""T5's relative position bias, looked up over the batch at the parent's ``compute_bias``.

T5 (Raffel et al. 2020, §2.1) adds to each head's attention logits a scalar per (query, key) offset bucket:
an nn.Embedding of H columns called on the (q, k) buckets inside its attention's ``compute_bias``, whose
output is permuted to (1, H, q, k) there and added to every example's (B, H, q, k) logits, in this layer
and in each later one, which reuse it. Such a call could be followed to its broadcast eagerly
(:mod:`.broadcast_params`), but not in compiled code, and expanding the embedding's own output over the
batch (:mod:`.expand_plan`) would break the permute that comes after it.

So a method of :data:`METHODS` on the direct parent of a plain nn.Embedding is patched for the context. At
its first call with given arguments it runs eagerly (under compile: a graph break; what it calls too,
:class:`~.eager_parent.CallbackAside`) with the embedding replaced by a stand-in that keeps its index and
returns a tensor on the meta device, so that nothing is computed: the result must be a view of that tensor
(permutes, unsqueezes) with a leading unit dim (where the batch broadcasts), and the view's strides give
the layout. Kept by the call's arguments (T5's lengths and offset, plain ints), that layout and index then
serve every eager call: the lookup once, expanded over the batch as a view, handed to the embedding's hook
as a call on ``idx.expand(B, …)``, and returned in that layout with the batch on the leading dim. A traced
call does the same with no graph break, by the layout learned for its arguments' signature (ints as a
marker, their values unread): the method is traced with the embedding swapped for a :class:`_Capture`,
which keeps the index it is called on, so that symbolic lengths stay symbolic (after Dynamo marks a length
dynamic, a new length compiles nothing more) and the lookup is expanded as above.

Every example's slice is the batch-less bias, so no value downstream changes; the gradient that reaches the
expansion is each example's, summed over every layer that reuses the bias, and the embedding rule reads it
(so T = B, where the index looks batched, is no longer ambiguous). A result of any other form (not a view
of the lookup) leaves the method as it was: followed eagerly, refused by name under compile.
"""
from __future__ import annotations

import torch
from torch import nn

from elasticlab.gns import hooks
from elasticlab.gns.layers.eager_parent import CallbackAside, disable

# methods a parent calls its batch-less embedding child in: Hugging Face's T5, mT5, UMT5, LongT5, Switch
# Transformers, Pix2Struct, UDOP and Pop2Piano (each attention with a relative_attention_bias)
METHODS = ("compute_bias",)


class _StandIn:
    """In place of the embedding for the first pass: keeps the index, returns its lookup's shape on meta."""

    def __init__(self, emb: nn.Embedding):
        self._emb, self.index = emb, None

    def __call__(self, index, *args, **kwargs):
        self.index = index
        self.out = torch.empty((*index.shape, self._emb.embedding_dim), dtype=self._emb.weight.dtype,
                               device="meta")
        return self.out

    def __getattr__(self, name):          # (the method may read its weight's device, its sizes)
        return getattr(self._emb, name)


def layout(looked: torch.Tensor, out) -> list[int] | None:
    """The non-unit dims of ``looked`` (contiguous), in the order ``out`` holds them, where ``out`` is a view
    of all of it with a leading unit dim (only permuted, unit dims added or removed); else None."""
    if not (isinstance(out, torch.Tensor) and out.device.type == "meta" and out._base is looked
            and out.storage_offset() == 0 and out.numel() == looked.numel() and out.dim() >= 1
            and out.shape[0] == 1):
        return None
    mine = {(looked.stride(i), looked.shape[i]): i for i in range(looked.dim()) if looked.shape[i] != 1}
    order = [mine.pop((out.stride(j), out.shape[j]), None) for j in range(out.dim()) if out.shape[j] != 1]
    return None if None in order or mine else order


def over_batch(looked: torch.Tensor, order: list[int], shape: torch.Size) -> torch.Tensor:
    """``looked`` (B, …), the lookup over the batch, in the layout :func:`layout` read (``shape``: the
    batch-less result's), the batch on its leading dim."""
    kept = [i for i in range(1, looked.dim()) if looked.shape[i] != 1]
    lined = looked.reshape(looked.shape[0], *(looked.shape[i] for i in kept))
    lined = lined.permute(0, *(1 + kept.index(1 + i) for i in order))
    return lined.reshape(looked.shape[0], *shape[1:])


class _Capture:
    """In place of the embedding while a compiled method is traced: keeps the index (on symbolic lengths
    too) and its lookup, which is then expanded over the batch; the method's own result lends its shape."""

    def __init__(self, emb: nn.Embedding):
        self._emb, self.index = emb, None

    def __call__(self, index, *args, **kwargs):
        self.index, self.out = index, nn.Embedding.forward(self._emb, index)
        return self.out

    def __getattr__(self, name):
        return getattr(self._emb, name)


_UNKNOWN, _MIXED = object(), object()      # (a signature not learned yet; learned with two layouts)
_INT = "\0int"                            # (an int in a signature, its value unread)


def _signature(args: tuple, kwargs: dict) -> tuple | None:
    """:func:`_key` with each int replaced by a marker, its value unread: a traced call on symbolic lengths
    then adds no guard on them (no recompilation per length)."""
    return _key(tuple(_INT if type(v) is int else v for v in args),
                {k: _INT if type(v) is int else v for k, v in kwargs.items()})


def _key(args: tuple, kwargs: dict) -> tuple | None:
    """A call's arguments as a key (plain ints, flags, devices: T5's lengths and offset), or None."""
    vals = (*args, *kwargs.values())
    if not all(v is None or type(v) in (int, bool, str) or isinstance(v, torch.device) for v in vals):
        return None
    return tuple(str(v) if isinstance(v, torch.device) else v for v in args), tuple(
        (k, str(v) if isinstance(v, torch.device) else v) for k, v in sorted(kwargs.items()))


def _over_batch(hook, emb: nn.Embedding, got: tuple, B: int, out=None) -> torch.Tensor:
    """The lookup once (``out``, where done), expanded over the batch as a view (nothing copied B times),
    handed to the embedding's hook as a call on the expanded index, then laid out as the method lays its
    result out."""
    index, order, shape = got
    if out is None:
        out = nn.Embedding.forward(emb, index)                   # (its class's forward: no hook runs)
    view = out.unsqueeze(0).expand(B, *out.shape)
    new = hook(emb, (index.expand(B, *index.shape),), {}, view)
    return over_batch(view if new is None else new, order, shape)


class _Patch:
    """The method of one parent replaced for the context; :meth:`remove` puts back what was there."""

    def __init__(self, parent: nn.Module, name: str, child: str, slot):
        self.parent, self.name, self.had = parent, name, parent.__dict__.get(name)
        original = getattr(parent, name)
        known: dict = {}      # call key -> (index, layout, batch-less result's shape), or None: eager calls
        layouts: dict = {}    # call signature (ints unread) -> layout, None, or _MIXED: traced calls
        hook = hooks.forward_hook(slot.owner, slot)      # (the embedding's, called on the expanded lookup)

        def learn(args, kwargs):
            """The meta pass: (index, layout, shape), or None where the result is not a view of the lookup."""
            emb = parent._modules[child]
            stand = _StandIn(emb)
            parent._modules[child] = stand
            try:
                out = original(*args, **kwargs)
            except (RuntimeError, NotImplementedError, TypeError):     # (not a computation meta runs)
                out = None
            finally:
                parent._modules[child] = emb
            order = None if stand.index is None else layout(stand.out, out)
            return None if order is None else (stand.index, order, out.shape)

        def eager(*args, **kwargs):
            B, key = slot.owner._batch, _key(args, kwargs)
            if B is None:
                return original(*args, **kwargs)
            with CallbackAside():
                if key is not None and key not in known:      # (learned in an eager step too: not traced)
                    known[key] = learn(args, kwargs)          # (None: not a view of the lookup)
                    sig, order = _signature(args, kwargs), known[key] and known[key][1]
                    layouts[sig] = order if layouts.get(sig, order) == order else _MIXED
                got = known[key] if key is not None else learn(args, kwargs)
                if got is not None:
                    return _over_batch(hook, parent._modules[child], got, B)
            return original(*args, **kwargs)     # (as it was: followed eagerly, refused by name compiled)

        eager = disable(eager)

        def traced(B, order, args, kwargs):
            """The method traced with the embedding swapped for a :class:`_Capture`: its index (on symbolic
            lengths too) looked up over the batch in the learned layout."""
            emb = parent._modules[child]
            capture = _Capture(emb)
            parent._modules[child] = capture
            try:
                out = original(*args, **kwargs)
            finally:
                parent._modules[child] = emb
            if capture.index is None:              # (this call did not look the bias up)
                return out
            return _over_batch(hook, emb, (capture.index, order, out.shape), B, capture.out)

        def method(*args, **kwargs):
            if torch.compiler.is_compiling():      # traced: the lookup over the batch, no graph break
                sig, B = _signature(args, kwargs), slot.owner._batch
                order = layouts.get(sig, _UNKNOWN) if sig is not None and B is not None else _UNKNOWN
                if order is None:                  # (learned not to be a view: the method traced as it is)
                    return original(*args, **kwargs)
                if order is not _UNKNOWN and order is not _MIXED:
                    return traced(B, order, args, kwargs)
            return eager(*args, **kwargs)

        setattr(parent, name, method)

    def remove(self) -> None:
        if self.had is None:
            delattr(self.parent, self.name)
        else:
            setattr(self.parent, self.name, self.had)


def install(owner) -> list[_Patch]:
    """For each nn.Embedding slot called without the batch (``Rule.unbatched``) whose direct parent has a
    method of :data:`METHODS`, that method patched (:class:`_Patch`); the handles to remove at the exit."""
    patches = []
    for s in owner._slots:
        if not (type(s.module) is nn.Embedding and s.rule.unbatched and s.name):
            continue
        parent_name, _, child = s.name.rpartition(".")
        parent = owner.model.get_submodule(parent_name)
        if parent._modules.get(child) is not s.module:
            continue
        patches += [_Patch(parent, m, child, s) for m in METHODS if callable(getattr(parent, m, None))]
    return patches
