"""Layers called on the examples folded into dim 0 with their positions: OPT's decoder runs its MLP and its
final LayerNorm on the hidden states reshaped to (B·T, D); a (T, B, D) tensor flattened to (T·B, D).

A row-wise layer (its output row r depends on input row r alone: Linear, LayerNorm, RMSNorm; ``Rule.folds``)
gives each example's gradient as the sum over that example's rows, so its rule, handed the input and the
output gradient unfolded to (B, k, …), gives the same norms as for a sequence. Which rows belong to which
example is read from the autograd graph of the input (:func:`find`): the input is followed back through ops
that keep its rows apart (views, elementwise ops, LayerNorm, a Linear's matmul) to the view that folded it,
from (B, k, …) (batch-major: rows b·k … b·k+k−1 are example b's) or from (k, B, …) (rows b, B+b, …). Found
once per layer and input shape, and cached; where it is not found (no such view, or both layouts fit
because k equals the batch) the layer reads dim 0 as the examples as before, and the readers' batch sizes
disagree (an error). Eager only: under ``torch.compile`` a folded call is not unfolded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ENABLED = True
MAX_HOPS = 24                          # autograd nodes followed back from a layer's input
_VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "CloneBackward0",
          "ToCopyBackward0", "AliasBackward0"}
_ROWWISE = {"AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0", "NegBackward0", "GeluBackward0",
            "ReluBackward0", "SiluBackward0", "TanhBackward0", "SigmoidBackward0", "NativeDropoutBackward0",
            "NativeLayerNormBackward0", "PowBackward0", "ExpBackward0"}


@dataclass(frozen=True)
class Fold:
    """The layout of R = batch·per rows: batch-major (``major``: row b·per + j is example b's) or not
    (row j·batch + b)."""
    batch: int
    per: int
    major: bool

    def unfold(self, t: torch.Tensor) -> torch.Tensor:
        """(R, …) → (batch, per, …)."""
        if self.major:
            return t.reshape(self.batch, self.per, *t.shape[1:])
        return t.reshape(self.per, self.batch, *t.shape[1:]).transpose(0, 1).contiguous()

    def refold(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, per, …) → (R, …), the inverse of :meth:`unfold`."""
        if self.major:
            return t.reshape(self.batch * self.per, *t.shape[2:])
        return t.transpose(0, 1).reshape(self.batch * self.per, *t.shape[2:])


def _shape(fn, nr: int) -> tuple | None:
    meta = getattr(fn, "_input_metadata", None)
    return tuple(meta[nr].shape) if meta is not None and nr < len(meta) else None


def find(t: torch.Tensor, batch: int) -> Fold | None:
    """The layout of ``t``'s rows (dim 0 a multiple k > 1 of ``batch``) read from its autograd graph, or None
    when no path back to a folding view is found, or the paths disagree."""
    R = t.shape[0]
    stack, seen, found = [(t.grad_fn, tuple(t.shape), 0)], set(), set()
    while stack:
        node, out, hops = stack.pop()
        if node is None or id(node) in seen or hops > MAX_HOPS or not out:
            continue
        seen.add(id(node))
        name, per_row = node.name(), math.prod(out) // R
        kids = [(c, s) for c, i in node.next_functions if c is not None
                and (s := _shape(c, i)) is not None]
        if name in _VIEWS and kids:
            c, S = kids[0]
            if len(S) > 1 and S[0] == batch and S[1] != batch and math.prod(S) == R * per_row:
                found.add(Fold(batch, R // batch, True))
            elif len(S) > 1 and S[1] == batch and S[0] != batch and S[0] * batch == R \
                    and math.prod(S[2:]) == per_row:
                found.add(Fold(batch, S[0], False))
            elif S and S[0] == R:
                stack.append((c, S, hops + 1))
        elif name in _ROWWISE:
            stack += [(c, s, hops + 1) for c, s in kids if s == out]
        elif name in ("MmBackward0", "AddmmBackward0") and kids:
            c, s = kids[0] if name == "MmBackward0" else kids[-2]
            if s[0] == out[0]:
                stack.append((c, s, hops + 1))
    return found.pop() if len(found) == 1 else None


def fold_for(slot, x) -> Fold | None:
    """The layout of a row-wise layer's folded input ``x``, or None where dim 0 is the batch (cached per
    input shape)."""
    if torch.compiler.is_compiling():          # (first: no guard on the batch in a compiled graph)
        return None
    B = slot.owner._batch
    if (not ENABLED or B is None or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] == B
            or x.shape[0] % B or x.grad_fn is None):
        return None
    key = (B, tuple(x.shape))
    if key not in slot.folds:
        slot.folds[key] = find(x, B)
    return slot.folds[key]


def unfolding(slot, forward):
    """A row-wise layer's fused forward, run on its input unfolded to (B, k, …) where it is folded."""
    def run(x, *args, **kwargs):
        fold = fold_for(slot, x)
        if fold is None:
            return forward(x, *args, **kwargs)
        return fold.refold(forward(fold.unfold(x), *args, **kwargs))
    return run
