"""Which uses of a followed tensor (:class:`~elasticlab.gns.layers.broadcast_params.Followed`) are a layer's
op taken per example (:meth:`~elasticlab.gns.layers.broadcast_taps.Step.through`): the inputs that carry
the batch of F.linear, a convolution, a matmul or an einsum on followed weights; an input whose rows were
gathered from the examples (a mixture of experts' routed tokens); and an integer slice ``p[i]`` of a
parameter (an expert's weight), held as itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from elasticlab.gns import folds

# a layer's ops, on weights and inputs whose dim 0 is the batch (each example's output its input's alone)
LAYER_OPS = {F.linear, F.conv1d, F.conv2d, F.conv3d, torch.einsum}
MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__}


def slice_of(func, args: tuple) -> tuple | None:
    """(root, i) where ``func(*args)`` is ``root[i]``, an integer index into dim 0 of a parameter's alias
    (a mixture of experts' ``gate_up_proj[e]``): its per-example gradients are then held for that slice
    alone (:meth:`~elasticlab.gns.layers.broadcast_taps.Step.add`)."""
    if func is not torch.Tensor.__getitem__ or len(args) != 2:
        return None
    root, i = args
    if getattr(root, "_root", None) is None or root._root[0] not in ("param", "child"):
        return None
    if isinstance(i, torch.Tensor) and i.dim() == 0 and not i.is_floating_point() and i.dtype != torch.bool:
        i = int(i)                                 # (one host read: HF's loop over experts has made it)
    return (root, i) if isinstance(i, int) and not isinstance(i, bool) else None


def layer_inputs(func, args: tuple, fol: list, others: list, B: int) -> list | None:
    """The inputs carrying the batch of a layer's op on followed weights, where each example's output is its
    input's alone: F.linear's and the convolutions' input (dim 0 the batch, the weights followed), a matmul's
    left operand of 2+ dimensions or right operand of 3+ (dim 0 not contracted), an einsum's operands whose
    batch letter leads the output; else None."""
    batched = [a for a in others if a.dim() and a.shape[0] == B]
    if func is torch.einsum:
        return einsum_inputs(args, fol, batched, others)
    if len(batched) != 1 or any(a.requires_grad and a is not batched[0] for a in others):
        return None
    x = batched[0]
    if func in LAYER_OPS:
        return batched if args and args[0] is x and x.dim() >= 2 else None
    if len(args) < 2 or not any(a is x for a in args[:2]):
        return None
    left = args[1] if func is torch.Tensor.__rmatmul__ else args[0]
    return batched if (x is left and x.dim() >= 2) or (x is not left and x.dim() >= 3) else None


def gathered_input(func, args: tuple, others: list, B: int, folded: bool = False) -> tuple | None:
    """(x, the example of each of its rows) where a row-wise layer's op on followed weights (F.linear, a
    matmul with x on the left) takes an input x whose rows were gathered from the examples (a mixture of
    experts: the tokens routed to one expert, ``gate_up_proj[e]`` its weight), read from x's graph
    (:func:`elasticlab.gns.folds.row_examples`), and the batch ``B`` (the model's: the module may be called
    on the tokens folded into dim 0, Mixtral's experts); else None. ``folded``: the module was called on
    rows that fold the batch, so an input of B rows is a gather that has as many by chance."""
    trained = [a for a in others if a.requires_grad]
    if len(trained) != 1 or not args:
        return None
    x = trained[0]
    left = args[1] if func is torch.Tensor.__rmatmul__ else args[0]
    if x is not left or x.dim() < 2 or (x.shape[0] == B and not folded) or not folds.ENABLED:
        return None
    ex = folds.row_examples(x, B)
    return None if ex is None or ex.numel() != x.shape[0] else (x, ex, B)


def einsum_inputs(args: tuple, fol: list, batched: list, others: list) -> list | None:
    """An einsum's operands carrying the batch (Funnel's ``einsum("binh,dnh->bind", q, r_kernel)``): each
    with the batch first under one letter that leads the output and no followed operand's term has; else
    None (an ellipsis, or the batch contracted)."""
    eq, ops = args[0], list(args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or "..." in eq or "->" not in eq:
        return None
    ins, out = eq.replace(" ", "").split("->")
    terms = ins.split(",")
    if len(terms) != len(ops) or not out or not batched:
        return None
    term = {id(a): t for a, t in zip(ops, terms)}
    b = out[0]
    if any(id(a) not in term for a in (*fol, *batched)) or any(b in term[id(f)] for f in fol):
        return None
    if any(term[id(x)][:1] != b for x in batched):
        return None
    rest = [a for a in others if all(a is not x for x in batched)]
    return None if any(a.requires_grad or b in term.get(id(a), "") for a in rest) else batched


GROUPED = {torch._grouped_mm, getattr(F, "grouped_mm", torch._grouped_mm)}


def grouped_input(func, args: tuple, kwargs: dict, fol: list, others: list, B: int,
                  folded: bool = False) -> tuple | None:
    """(x, the example of each of its rows, B, offs, the parameter) where a grouped matmul (a mixture of
    experts in one call: Hugging Face's ``grouped_mm`` experts, ``x @ W[e]ᵀ`` for the rows of each group e)
    takes a 2-D input x gathered from the examples and a followed (E, K, N) weight that is a parameter or
    its transpose in the last two dimensions, with ``offs`` and no bias; else None."""
    if func not in GROUPED or len(args) < 2 or len(fol) != 1 or args[1] is not fol[0]:
        return None
    w, offs = fol[0], kwargs.get("offs")
    root = w if w._root is not None else getattr(w, "_transpose_of", None)
    if root is None or root._root[0] not in ("param", "child") or w.dim() != 3 \
            or not isinstance(offs, torch.Tensor) or offs.dim() != 1 or kwargs.get("bias") is not None:
        return None
    got = gathered_input(torch.matmul, args[:1], others, B, folded)
    return None if got is None or got[0] is not args[0] else (*got, offs, root)


def transpose_of(func, args: tuple):
    """The parameter's alias of which ``func(*args)`` is the transpose in the last two dimensions
    (``gate_up_proj.transpose(-2, -1)``), else None."""
    if func not in (torch.Tensor.transpose, torch.transpose) or len(args) != 3:
        return None
    root, a, b = args
    if getattr(root, "_root", None) is None or root._root[0] not in ("param", "child"):
        return None
    n = root.dim()
    return root if n >= 2 and {a % n, b % n} == {n - 2, n - 1} else None

