"""Layers called on the examples folded into dim 0 with their positions: OPT's decoder runs its MLP and its
final LayerNorm on the hidden states reshaped to (B·T, D); a (T, B, D) tensor flattened to (T·B, D).

A row-wise layer (its output row r depends on input row r alone: Linear, LayerNorm, RMSNorm; ``Rule.folds``)
gives each example's gradient as the sum over that example's rows, so its rule, handed the input and the
output gradient unfolded to (B, k, …), gives the same norms as for a sequence. Which rows belong to which
example is read from the autograd graph of the input (:func:`find`): the input is followed back through ops
that keep its rows apart (views, elementwise ops, LayerNorm, a Linear's matmul) to the view that folded it,
from (B, k, …) (batch-major: rows b·k … b·k+k−1 are example b's) or from (k, B, …) (rows b, B+b, …). Where
both layouts fit the view's shape (k equals the batch: (B, B, …)), the batch's place in that tensor is read
further back (:func:`batch_factor`: through views, elementwise ops, transposes and matmuls to a tensor made
from the model's inputs, whose dim 0 is the batch). Found once per layer and input shape, and cached; where
it is not found the layer reads dim 0 as the examples as before, and the readers' batch sizes disagree (an
error). The graph is read eagerly only: under ``torch.compile`` a folded call is unfolded by the layout an
eager step found for its batch and input shape (the same code on the same shapes), and not otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ENABLED = True
MAX_HOPS = 32                          # autograd nodes followed back from a layer's input
MAX_SHAPES = 32                        # input shapes whose layout is kept per layer (then found afresh)
_VIEWS = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "CloneBackward0",
          "ToCopyBackward0", "AliasBackward0"}
_ROWWISE = {"AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0", "NegBackward0", "GeluBackward0",
            "ReluBackward0", "SiluBackward0", "TanhBackward0", "SigmoidBackward0", "NativeDropoutBackward0",
            "NativeLayerNormBackward0", "PowBackward0", "ExpBackward0", "AddBackward1", "SubBackward1",
            "MulBackward1", "DivBackward1"}
_ROWS_KEPT = {"TransposeBackward0", "PermuteBackward0", "ExpandBackward0", "SoftmaxBackward0",
              "LogSoftmaxBackward0", "SafeSoftmaxBackward0"}


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

    def sum_rows(self, t: torch.Tensor) -> torch.Tensor:
        """(R, …) → (batch, …): each example's rows summed."""
        if self.major:
            return t.reshape(self.batch, self.per, *t.shape[1:]).sum(1)
        return t.reshape(self.per, self.batch, *t.shape[1:]).sum(0)

    def unfold_call(self, saved: tuple, g: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """A hooked call's saved inputs and output gradient unfolded to (batch, per, …): those of its R rows
        (other inputs, such as a weight, as they are)."""
        R = g.shape[0]
        return (tuple(self.unfold(t) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == R else t
                      for t in saved), self.unfold(g))

    def refold(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, per, …) → (R, …), the inverse of :meth:`unfold`."""
        if self.major:
            return t.reshape(self.batch * self.per, *t.shape[2:])
        return t.transpose(0, 1).reshape(self.batch * self.per, *t.shape[2:])


def grad_shapes(node) -> tuple | None:
    """The shapes of the gradients an autograd node receives (its forward op's outputs), or None where the
    node does not say."""
    meta = getattr(node, "_input_metadata", None)
    return None if meta is None else tuple(tuple(m.shape) for m in meta)


def _shape(fn, nr: int) -> tuple | None:
    shapes = grad_shapes(fn)
    return shapes[nr] if shapes is not None and nr < len(shapes) else None


def _keeps_rows(node, out: tuple) -> bool:
    """Whether a node in ``_ROWWISE`` keeps its output's rows apart (a LayerNorm whose normalized shape
    reaches dim 0 mixes them)."""
    if node.name() != "NativeLayerNormBackward0":
        return True
    return len(getattr(node, "_saved_normalized_shape", out)) < len(out)


def _keeps_dim0(node) -> bool:
    """A transpose or permute that leaves dim 0 in place (the heads split off: ``view(R, T, H, d)
    .transpose(1, 2)``), or an expand of the other dimensions (matmul's)."""
    name = node.name()
    if name == "TransposeBackward0":
        return 0 not in (getattr(node, "_saved_dim0", 0), getattr(node, "_saved_dim1", 0))
    if name == "PermuteBackward0":
        dims = getattr(node, "_saved_dims", (1,))
        return len(dims) > 0 and dims[0] == 0
    if name in ("SoftmaxBackward0", "LogSoftmaxBackward0", "SafeSoftmaxBackward0"):
        dim = getattr(node, "_saved_dim", 0)
        dim = dim - 2 ** 64 if dim >= 2 ** 63 else dim          # (an int64 read back unsigned)
        return dim != 0 and dim != -len(getattr(node, "_saved_result", ()))
    return name == "ExpandBackward0" or name.startswith("ScaledDotProduct")    # (attention: the query's rows)


_MATMUL_LIKE = {"MmBackward0", "AddmmBackward0", "BmmBackward0"}
_ROW_LAYERS = ("LinearNorms", "LayerNormNorms", "RMSNormNorms")      # (the fused rules' own nodes)


def _perm(node, n: int) -> list[int] | None:
    """The forward's permutation (output dim i is input dim p[i]) of a transpose or permute node."""
    if node.name() == "TransposeBackward0":
        a, b = (d - 2 ** 64 if d >= 2 ** 63 else d for d in (node._saved_dim0, node._saved_dim1))
        p = list(range(n))
        p[a % n], p[b % n] = p[b % n], p[a % n]
        return p
    dims = list(getattr(node, "_saved_dims", ()))
    return [d % n for d in dims] if len(dims) == n else None


_LOOKUPS = {"IndexBackward0", "IndexSelectBackward0", "GatherBackward0"}  # (and embeddings: data as indices)
_OF_PARAMS = _VIEWS | _ROWWISE | {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0",
                                  "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1"}


_BATCH_FIRST = {"ConvolutionBackward0", "NativeGroupNormBackward0", "MaxPool2DWithIndicesBackward0",
                "AvgPool2DBackward0"}
_BATCH_FIRST_FUSED = ("ConvNorms", "GroupNormNorms")                  # (the fused rules' own nodes)
_DATA_LAYERS = {"ConvolutionBackward0", "NativeLayerNormBackward0", "NativeGroupNormBackward0"}


def _keeps_batch_first(node, n: int) -> bool:
    """An op whose output's dim 0 is its first input's, with nothing mixed across it (a convolution, a pool,
    a pad or a roll of the other dims, a GroupNorm): a batch first in its input stays first."""
    name = node.name()
    if name == "ConstantPadNdBackward0":
        return len(getattr(node, "_saved_pad", ())) // 2 < n
    if name == "RollBackward0":                # (no dims: the flattened tensor rolled, across the batch)
        dims = tuple(getattr(node, "_saved_dims", ()))
        return bool(dims) and all(d % n != 0 for d in dims)
    return name in _BATCH_FIRST or any(r in name for r in _BATCH_FIRST_FUSED)


def _keeps_rows_of_left(name: str) -> bool:
    """A matmul, attention or fused row layer: all but the last dim of its first (left) operand kept."""
    return name in _MATMUL_LIKE or name.startswith("ScaledDotProduct") or any(r in name for r in _ROW_LAYERS)


def _data_pos(name: str) -> int:
    """Which autograd edge of a layer's node is its data operand: F.linear's (addmm's) left one, else the
    first."""
    return 1 if name == "AddmmBackward0" else 0


def _on_data(node) -> bool:
    """A layer's node whose data operand has no history (the model's input, or a view of it): F.linear's
    matmul by its left operand, a convolution or a norm by its input; or a lookup (an embedding), whose
    indices are data. Not an elementwise op with a constant, nor parameters alone (latents expanded)."""
    name = node.name()
    if name in _LOOKUPS or "Embedding" in name:
        return True
    layer = name in _MATMUL_LIKE or name in _DATA_LAYERS or any(r in name for r in _ROW_LAYERS)
    layer = layer or any(r in name for r in _BATCH_FIRST_FUSED)
    nf, pos = node.next_functions, _data_pos(name)
    return layer and len(nf) > pos and nf[pos][0] is None


def _params_only(node, depth: int = 0) -> bool:
    """Whether an autograd node's history holds parameters alone (a weight's transpose: no batch in it): ops
    that take no input outside their autograd edges (not an embedding's lookup, whose indices are data)."""
    if node.name().endswith("AccumulateGrad"):
        return True
    kids = [c for c, _ in node.next_functions]              # (None: an input without history, maybe data)
    return depth < 4 and node.name() in _OF_PARAMS and bool(kids) and all(
        c is not None and _params_only(c, depth + 1) for c in kids)


def batch_factor(node, out: tuple, batch: int, hops: int = 0) -> tuple[int, int] | None:
    """Where the batch lies in a tensor of shape ``out`` made by ``node``: (outer, inner), its elements'
    flat index being (o·batch + b)·inner + i (dim 0 the batch: (1, ∏ out[1:])), or None where that is not
    read. Followed back through views (the flat index is theirs too), elementwise ops (the operands of the
    same shape whose layout is read must agree), transposes and permutes, matmuls and attention (all but
    the last dim of the first operand kept), and ops that keep a batch first (convolutions, pads), to an
    op none of whose inputs carries history but parameters, a layer on data without history
    (:func:`_on_data`): the model's inputs (or a view of them, as F.linear folds a 3-D input), which take
    the batch first (every rule reads them so). Parameters alone (latents expanded), or with constants, are
    not read."""
    if node is None or hops > MAX_HOPS or not out or node.name().endswith("AccumulateGrad"):
        return None                            # (a leaf's own rows: a parameter's are no examples')
    name, total = node.name(), math.prod(out)
    kids = [(c, s) for c, i in node.next_functions if c is not None and (s := _shape(c, i)) is not None
            and not _params_only(c)]
    if not kids:                               # (made from parameters and tensors without history only)
        return (1, total // batch) if _on_data(node) and out[0] % batch == 0 else None
    if name in _VIEWS:
        got = batch_factor(kids[0][0], kids[0][1], batch, hops + 1)
        return got if got is not None and math.prod(kids[0][1]) == total else None
    if name in _ROWWISE and _keeps_rows(node, out):
        got = {batch_factor(c, s, batch, hops + 1) for c, s in kids if s == out} - {None}
        return got.pop() if len(got) == 1 else None    # (as find: an operand whose layout is read)
    if name in ("TransposeBackward0", "PermuteBackward0"):
        c, S = kids[0]
        got, p = batch_factor(c, S, batch, hops + 1), _perm(node, len(out))
        if got is None or p is None or len(S) != len(out):
            return None
        o, inner = got                          # (the input dim j holding the batch, and its place in it)
        j = next((j for j in range(len(S)) if inner % math.prod(S[j + 1:]) == 0
                  and math.prod(S[j:]) % (inner * batch) == 0), None)
        if j is None:
            return None
        k = p.index(j)
        new = math.prod(out[k + 1:]) * (inner // math.prod(S[j + 1:]))
        return total // batch // new, new
    keeps_first = _keeps_batch_first(node, len(out))
    if not (keeps_first or _keeps_rows_of_left(name)):
        return None
    c, i = node.next_functions[_data_pos(name)]
    S = _shape(c, i) if c is not None and not _params_only(c) else None
    if S is None:                              # (another input carries the batch: not read)
        return None
    got = batch_factor(c, S, batch, hops + 1)
    if keeps_first:
        return (1, total // batch) if got is not None and got[0] == 1 and S[0] == out[0] else None
    keep = S[-1] * (S[-2] if name.startswith("ScaledDotProduct") else 1)        # (attention mixes the keys)
    if got is None or tuple(S[:-1]) != tuple(out[:-1]) or got[1] % keep:
        return None
    return got[0], got[1] // S[-1] * out[-1]


def _square(c, S: tuple, batch: int) -> bool | None:
    """For a view's input of shape (batch, batch, …): True where its dim 0 is the batch, False where dim 1
    is, None where neither is read (:func:`batch_factor`) or the shape is not such."""
    if len(S) < 2 or not S[0] == S[1] == batch:
        return None
    got = batch_factor(c, S, batch)
    rest = math.prod(S[2:])
    return True if got == (1, batch * rest) else False if got == (batch, rest) else None


def find(t: torch.Tensor, batch: int) -> Fold | None:
    """The layout of ``t``'s rows (dim 0 a multiple k > 1 of ``batch``) read from its autograd graph, or None
    when no path back to a folding view is found, or the paths disagree. Along the way dim 0 may fold the
    rows further (a multiple of them: the heads of an attention's matmul, R·H)."""
    R = t.shape[0]
    stack, seen, found = [(t.grad_fn, tuple(t.shape), 0)], set(), set()
    while stack:
        node, out, hops = stack.pop()
        if node is None or id(node) in seen or hops > MAX_HOPS or not out or out[0] % R:
            continue
        seen.add(id(node))
        name, per_row = node.name(), math.prod(out) // R
        kids = [(c, s) for c, i in node.next_functions if c is not None
                and (s := _shape(c, i)) is not None]
        if name in _VIEWS and kids:
            c, S = kids[0]
            sq = _square(c, S, batch)
            if len(S) > 1 and S[0] == batch and (S[1] != batch or sq) and math.prod(S) == R * per_row:
                found.add(Fold(batch, R // batch, True))
            elif len(S) > 1 and S[1] == batch and (S[0] != batch or sq is False) and S[0] * batch == R \
                    and math.prod(S[2:]) == per_row:
                found.add(Fold(batch, S[0], False))
            elif S and S[0] % R == 0 and math.prod(S) == math.prod(out):
                stack.append((c, S, hops + 1))
        elif name in _ROWWISE and _keeps_rows(node, out):
            stack += [(c, s, hops + 1) for c, s in kids if s == out]
        elif (name in _ROWS_KEPT or name.startswith("ScaledDotProduct")) and _keeps_dim0(node) and kids:
            stack += [(c, s, hops + 1) for c, s in kids[:1] if s and s[0] == out[0]]
        elif name in ("MmBackward0", "AddmmBackward0", "BmmBackward0") and kids:
            c, s = kids[-2] if name == "AddmmBackward0" else kids[0]
            if s and s[0] == out[0]:
                stack.append((c, s, hops + 1))
    return found.pop() if len(found) == 1 else None


def fold_for(slot, x) -> Fold | None:
    """The layout of a row-wise layer's folded input ``x``, or None where dim 0 is the batch (cached per
    input shape). Under ``torch.compile``, and out of compiled graphs, it is not read: the layout an eager
    step found at this batch and input shape, or at another batch (:func:`_at_batch`), else None."""
    B = slot.owner._batch
    if torch.compiler.is_compiling():
        if not slot.folds or not ENABLED or B is None or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return None                        # (first: no guard on the batch where nothing was learned)
        key = (B, tuple(x.shape))
        return slot.folds[key] if key in slot.folds else _at_batch(slot.folds, B, key[1])
    if (not ENABLED or B is None or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] == B
            or x.shape[0] % B or x.grad_fn is None):
        return None
    key = (B, tuple(x.shape))
    if key not in slot.folds:
        if len(slot.folds) >= MAX_SHAPES:          # (variable shapes: the oldest layout goes)
            del slot.folds[next(iter(slot.folds))]
        got = find(x, B)                           # (compile's eager parts: where its nodes hide the layout)
        slot.folds[key] = _at_batch(slot.folds, B, key[1]) if got is None and _out_of_compiled(x) else got
    return slot.folds[key]


def _out_of_compiled(x: torch.Tensor, limit: int = 64) -> bool:
    """Whether ``x``'s graph reaches, within ``limit`` nodes, a compiled graph's backward (AOTAutograd's
    ``CompiledFunctionBackward``): eager code after a graph break, or beside a compiled frame."""
    seen, todo = set(), [x.grad_fn]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is not None and node not in seen:
            if node.name().startswith("CompiledFunction"):
                return True
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return False


def _at_batch(found: dict, batch: int, shape: tuple) -> Fold | None:
    """A layout read with the same shape past dim 0 at another batch or number of rows per example (R =
    batch·per): the same code folds examples alike whatever their number and length (OPT's (B·T, D)); one of
    as many rows per example first, else the order all such layouts share."""
    if shape[0] == batch or shape[0] % batch:
        return None
    alike = [f for (_, seen), f in found.items() if f is not None and seen[1:] == shape[1:]]
    major = {f.major for f in alike if f.per == shape[0] // batch} or {f.major for f in alike}
    return Fold(batch, shape[0] // batch, major.pop()) if len(major) == 1 else None


def unfolding(slot, forward):
    """A row-wise layer's fused forward, run on its input unfolded to (B, k, …) where it is folded."""
    owner = slot.owner

    def run(x, *args, **kwargs):
        # one comparison, not a call of fold_for; traced, none without a fold (it would specialise the batch)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 \
                or torch.compiler.is_compiling() and not slot.folds or x.shape[0] == owner._batch:
            return forward(x, *args, **kwargs)
        fold = fold_for(slot, x)
        if fold is None:
            return forward(x, *args, **kwargs)
        return fold.refold(forward(fold.unfold(x), *args, **kwargs))
    return run


_GATHERS = {"IndexBackward0", "IndexSelectBackward0"}


def row_examples(t: torch.Tensor, batch: int) -> torch.Tensor | None:
    """The example of each row of ``t`` (dim 0 neither the batch nor a fold of it read as one: rows gathered
    from the examples' positions, a mixture of experts' tokens routed to one expert, Fedus et al. 2022,
    eq. 1), as a (rows,) index, or None where it is not found. Followed back through views, row-wise ops, a
    Linear's matmul and splits of other dimensions to a gather along dim 0 (``h[idx]``, ``index_select``),
    whose rows are its source's rows at the index, and from there to the view that folded the batch with
    its positions (:func:`find`'s layouts) or to a tensor whose dim 0 is the batch."""
    return _rows_of(t.grad_fn, tuple(t.shape), batch, 0, False)


def _rows_of(node, out: tuple, batch: int, hops: int, gathered: bool) -> torch.Tensor | None:
    if node is None or hops > MAX_HOPS or not out:
        return None
    R = out[0]
    if gathered and R == batch:                    # (the source of a gather: dim 0 the batch)
        return torch.arange(batch)
    name = node.name()
    kids = [(c, s) for c, i in node.next_functions if c is not None and (s := _shape(c, i)) is not None]
    if name in _GATHERS and kids:
        if name == "IndexBackward0":
            idx = getattr(node, "_saved_indices", ())
            if len(idx) != 1 or idx[0] is None or idx[0].dim() != 1:
                return None
            idx = idx[0]
        else:
            if getattr(node, "_saved_dim", 1) != 0:
                return None
            idx = node._saved_index
        if idx.dtype == torch.bool:
            idx = idx.nonzero().squeeze(1)
        c, S = kids[0]
        src = _rows_of(c, S, batch, hops + 1, True)
        return None if src is None else src.to(idx.device)[idx]
    if name in _VIEWS and kids:
        c, S = kids[0]
        sq = _square(c, S, batch)
        if len(S) > 1 and S[0] == S[1] == batch and sq is None and math.prod(S[:2]) == R:
            return None                                                  # (both layouts fit)
        if len(S) > 1 and S[0] == batch and sq is not False and math.prod(S[:2]) == R \
                and math.prod(S) == math.prod(out):
            return torch.arange(batch).repeat_interleave(S[1])          # (B, k, …) → rows b·k + j
        if len(S) > 1 and S[1] == batch and math.prod(S[:2]) == R and math.prod(S) == math.prod(out):
            return torch.arange(batch).repeat(S[0])                      # (k, B, …) → rows j·B + b
        if S and S[0] == R and math.prod(S) == math.prod(out):
            return _rows_of(c, S, batch, hops + 1, gathered)
        return None
    if name in _ROWWISE and _keeps_rows(node, out):    # (the operands whose rows are read must agree)
        got = [r for c, s in kids if s == out
               and (r := _rows_of(c, s, batch, hops + 1, gathered)) is not None]
        return got[0] if got and all(torch.equal(got[0], r) for r in got[1:]) else None
    if name in ("SplitBackward0", "SplitWithSizesBackward0") and kids:
        dim = getattr(node, "_saved_dim", 0)
        dim = dim - 2 ** 64 if dim >= 2 ** 63 else dim
        c, S = kids[0]
        return _rows_of(c, S, batch, hops + 1, gathered) if dim % len(S) != 0 and S[0] == R else None
    if name in ("MmBackward0", "AddmmBackward0", "GroupedMmBackward0") and kids:   # (a grouped matmul on 2-D
        c, s = kids[-2] if name == "AddmmBackward0" else kids[0]                  # rows: row r from row r)
        return _rows_of(c, s, batch, hops + 1, gathered) if s and len(s) == 2 and s[0] == R else None
    return None
