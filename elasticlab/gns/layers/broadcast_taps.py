"""The taps of :mod:`elasticlab.gns.layers.broadcast_params`: where a followed tensor is broadcast over the
batch, a hook on the broadcast takes each example's gradient of it, maps it back to the parameters it was
made from (a batched vjp), and sums a step's uses (:class:`Step`). Expanded to rows that fold the batch with
windows or positions (:class:`Rows`), each example's rows are summed first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.func import vjp, vmap
from torch.utils._pytree import tree_map

from elasticlab.gns import kernels
from elasticlab.gns.layers import expand_plan, row_grams

if TYPE_CHECKING:
    from elasticlab.gns.layers.broadcast_params import Followed


class Rows:
    """A followed tensor expanded to R = k·B rows, the batch folded with k windows or positions into dim 0
    (Swin's (B·nW, H, N, N) attention scores, Liu et al. 2021, eq. 4: its relative position bias added to
    them): example b's gradient is the sum over its rows, whose layout (``fold``, a
    :class:`~elasticlab.gns.folds.Fold`) is read from the batched tensor it meets. Where it was expanded by
    a constant of R rows (the shifted windows' mask), that is only later, at the op that takes the result
    with the batch (scaled_dot_product_attention's query): until then ``fold`` is None, and ``cancelled``
    where the result went on to an op that needs the tensor's own gradient (followed as before)."""
    __slots__ = ("R", "fold", "cancelled", "open", "plans")

    def __init__(self, R: int, fold=None):
        self.R, self.fold, self.cancelled, self.open = R, fold, False, False
        self.plans: list = []      # (a watched layer's Step, (dims, leading dims added)): .expand_plan


class Step:
    """One slot's per-example gradients of its followed parameters in the current step (``slot.follow``):
    its bare parameters, or, for a covered layer called without the batch, its own parameters."""

    def __init__(self, slot, layer: bool = False):
        self.slot, self.layer = slot, layer
        self.batch: int | None = None
        self.acc: dict[tuple, torch.Tensor] = {}      # {(id of slot, param, i): (B, *shape)} summed so far
        self.parts: dict[tuple, dict] = {}             # {(id of slot, param): {i: (B,) ‖sum‖²}}
        self.grams: dict[tuple, row_grams.RowGrams] = {}   # {(id of slot, param, i): its uses on rows}
        self.open = 0                                  # taps of the forward whose gradient has not come
        self.calls = 0                                 # (a layer) its calls without the batch this step
        self.shape: tuple = ()                         # (a layer) the output of its last such call
        self.expand = None                             # (a layer) its outputs' use learned, kept across
        # steps: (dims, leading dims added) where only broadcast over the batch, False if not (.expand_plan)

    def reset(self) -> None:
        """At each step's start (PerSampleGradNorms' forward pre-hook)."""
        self.batch, self.acc, self.parts, self.grams, self.open, self.calls = None, {}, {}, {}, 0, 0

    def refuse(self, f: Followed, func, folded: bool = False) -> None:
        """A use of followed parameters with batched or trainable tensors that is not a broadcast (or, with
        ``folded``, one expanded to rows whose layout was never found)."""
        name = func if isinstance(func, str) else (
            getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
        for c_name, shown in (("_VariableFunctionsClass.", "torch."), ("TensorBase.", "Tensor."),
                              ("_TensorBase.", "Tensor.")):
            name = shown + name[len(c_name):] if name.startswith(c_name) else name
        slot = self.slot
        mod = f"{slot.name or '(root)'!r} ({type(slot.module).__name__})"
        how = (f"is used by {name} with tensors that carry the batch or train, and not as a broadcast over "
               "the batch (expand, repeat, an elementwise op), so the per-example gradient is not known")
        if folded:
            how = (f"is expanded to rows that fold the batch with windows or positions, but reaches {name}, "
                   "so which rows are which example's is not known")
        if "grouped_mm" in name:
            how += ("; a mixture of experts' grouped matmul is read per example only on 2-D rows gathered "
                    "from the examples with offs and the weight a parameter or its transpose, a loop of "
                    "F.linear over the experts always (Hugging Face: "
                    "model.set_experts_implementation('eager'))")
        for s, pn in _names(f):
            s.unmeasured.setdefault(pn, (
                f"module {mod} ran without the batch (its output has shape {self.shape}, the batch "
                f"{self.batch}), and that output {how}; expand its input over the batch, e.g. "
                "pos.unsqueeze(0).expand(B, -1)") if self.layer else
                f"bare parameter {slot.full(pn)!r} of module {mod} {how}" if s is slot else
                f"parameter {s.full(pn)!r}, read by module {mod} without calling {s.name!r}, {how}")

    def tap(self, f: Followed, live: bool, ndim: int, rows: Rows | None = None) -> torch.Tensor:
        """``f`` expanded to the batch along dim 0 (leading 1s put first where it has fewer dimensions than
        the op's result, of ``ndim``), its gradient taken per example by a hook; with ``rows``, expanded to
        their R rows, each example's summed."""
        B, shape = self.batch, tuple(f.shape)
        e = f.reshape((1,) * (ndim - len(shape)) + shape) if ndim > len(shape) else f
        e = e.expand(rows.R if rows is not None else B, *e.shape[1:])
        if live and e.requires_grad:
            self.open += 1
            if rows is not None:
                rows.open = True
            e.register_hook(lambda g: self._take(f, shape, g, rows))
        return e

    def through(self, func, args: tuple, kwargs: dict, fol: list, batched: list, live: bool,
                rows: tuple | None = None):
        """``func`` (a layer's op: F.linear, a convolution, a matmul) on followed weights ``fol`` and inputs
        ``batched`` whose dim 0 is the batch: run as is, a hook on its output takes each example's gradient
        of the weights, the vjp of the op on example b at its output gradient (vmap over the examples, as
        the generic rule does), ∇W ℓ_b = J_W f(W, x_b)ᵀ δ_b. With ``rows`` (x, the example of each of its
        rows, the batch: a row-wise op's input gathered from the examples, tokens routed to one expert),
        example b's input is its rows, and the vjp runs once per example that has any (the others'
        gradients are zero)."""
        out = func(*args, **kwargs)
        if not (live and isinstance(out, torch.Tensor) and out.requires_grad):
            return out
        dev = batched[0].device.type                   # (under autocast, re-run as the forward ran)
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        holes = {id(a): _Hole(i) for i, a in enumerate((*fol, *batched))}
        kept = [t.detach() for t in (*fol, *batched)]
        rest = tree_map(lambda a: holes.get(id(a), a.detach()) if isinstance(a, torch.Tensor) else a,
                        (args, kwargs))

        roles = _linear_roles(func, args, kwargs, fol) if rows is not None else None

        def one(ws, *xs):                              # the op on one example (a batch of 1, or its rows)
            vals = [*ws, *(xs if rows is not None else (x.unsqueeze(0) for x in xs))]
            a, k = tree_map(lambda r: vals[r.i] if isinstance(r, _Hole) else r, rest)
            with torch.autocast(dev, dtype=cast or torch.bfloat16, enabled=cast is not None):
                return func(*a, **k)

        def grads(*xs_g):
            *xs, g = xs_g
            _, pull = vjp(lambda ws: one(ws, *xs), kept[:len(fol)])
            return pull(g if rows is not None else g.unsqueeze(0))[0]

        def take(g):
            from elasticlab.gns.layers.generic import chunk_size  # (its fallback registers after this one's)
            self.open -= 1
            if rows is not None:
                if roles is not None and (uses := _gram_uses(kept, fol, roles, rows[1:], g.detach())):
                    self.add(uses)
                    return
                self.add(list(zip(fol, _by_rows(grads, kept, len(fol), rows[1:], g.detach(), roles))))
                return
            with torch._C.DisableTorchFunctionSubclass():
                per = vmap(grads, chunk_size=chunk_size(g.shape[0], kept[:len(fol)]))(*kept[len(fol):],
                                                                                      g.detach())
            self.add(list(zip(fol, per)))

        if out._is_view():             # (an einsum's reshaped product: in-place ops later on a view of it,
            out = out.clone()          # as Funnel's relative shift makes, route the gradient past a view's
        self.open += 1                 # node; a base's own node, hooked here, always runs)
        nr = out.output_nr
        out.grad_fn.register_prehook(lambda gs: None if gs[nr] is None else take(gs[nr]))
        return out

    def grouped(self, func, args: tuple, kwargs: dict, live: bool, x, ex, B: int, offs, root):
        """A grouped matmul (``x @ W[e]ᵀ`` for the rows of group e, ``offs`` their ends) on x gathered from
        the examples and a followed weight made from ``root`` (itself, or transposed): run as is, a hook on
        its output hands each group's rows, sorted by example, to the Gram form as a use of the slice
        ``root[e]`` (:mod:`.row_grams`; transposing a slice leaves its norm as it is)."""
        out = func(*args, **kwargs)
        if not (live and isinstance(out, torch.Tensor) and out.requires_grad):
            return out
        kept, bounds = x.detach(), offs.detach()
        E = args[1].shape[0]

        def take(g):
            self.open -= 1
            grp = torch.searchsorted(bounds.to(torch.long), torch.arange(kept.shape[0], device=kept.device),
                                     right=True)
            on = (grp < E).nonzero().squeeze(1)                   # (rows past the last group: none's)
            key = grp[on] * B + ex.to(grp.device)[on]
            order, counts = row_grams.by_example(key, E * B)
            order = on[order]
            acc = kernels.acc_dtype(g.dtype)
            X, D = kept[order].to(acc), g.detach()[order].to(acc)
            uses, start = [], 0
            for e in range(E):
                c = counts[e * B:(e + 1) * B]
                n = sum(c)
                if n:
                    uses.append((_SliceOf(root, e), row_grams.RowsUse(X[start:start + n], D[start:start + n],
                                                                      c)))
                start += n
            if uses:
                self.add(uses)

        self.open += 1
        nr = out.output_nr
        out.grad_fn.register_prehook(lambda gs: None if gs[nr] is None else take(gs[nr]))
        return out

    def cancel(self, fol: list) -> None:
        """The expansions to rows of the tensors made from ``fol`` whose layout is not yet known: their
        result is used otherwise (and followed as such), so their taps take nothing."""
        for f in fol:
            for r in f._pending:
                if r.fold is None and not r.cancelled:
                    r.cancelled = True
                    self.open -= r.open
                    expand_plan.resolved(r)

    def _take(self, f: Followed, shape: tuple, g: torch.Tensor, rows: Rows | None = None) -> None:
        if rows is not None and rows.cancelled:
            return
        self.open -= 1
        if rows is not None:
            if rows.fold is None:
                self.refuse(f, "an op that never met the batch its rows fold", folded=True)
                expand_plan.resolved(rows)
                return
            g = rows.fold.sum_rows(g)                  # (R, …) → (B, …): each example's rows
        self.add([(f, g.detach().reshape(g.shape[0], *shape))])

    def add(self, uses: list) -> None:
        """Per-example gradients ``uses`` [(followed tensor, (B, *its shape))] of one tap: mapped back to the
        parameters, added to the step's, and the norms of the sums recorded (in the slot of the module that
        holds each parameter: this one's, or a child's whose weight it read). A slice ``p[i]`` along dim 0
        (an expert's weight) is held as itself, (B, *p[i].shape): the squared norm of p's per-example gradient
        is the sum over its slices', the slices being disjoint."""
        B = uses[0][1].shape[0] if isinstance(uses[0][1], torch.Tensor) else len(uses[0][1].counts)
        at = []
        for f, pe in uses:
            if f._root is not None:
                at.append((f._root, pe, None))
                continue
            if f._slice is not None:
                at.append((f._slice[0]._root, pe, f._slice[1]))
                continue
            with torch._C.DisableTorchFunctionSubclass(), torch.enable_grad():    # made from its roots by
                got = torch.autograd.grad(f, list(f._roots), pe, retain_graph=True,   # other ops: their vjp,
                                          allow_unused=True, is_grads_batched=True)  # each example's (no hook
            at += [(r._root, v, None) for r, v in zip(f._roots, got) if v is not None]  # of a parameter runs)
        per: dict[tuple, torch.Tensor] = {}
        for root, v, i in at:           # a parameter's alias: its own gradient; a layer's output: its vjp
            for (s, pn), w in _to_params(self.slot, root, v).items():
                per[s, pn, i] = w if (s, pn, i) not in per else per[s, pn, i] + w
        last = self.open <= 0                          # the step's last use: nothing more to hold
        norms: dict = {}
        for (s, pn, i), v in per.items():
            parts = self.parts.setdefault((id(s), pn), {})
            key, gram = (id(s), pn, i), isinstance(v, row_grams.RowsUse)
            if (key in self.grams and not gram) or (gram and key in self.acc):
                s.unmeasured.setdefault(pn, (
                    f"parameter {s.full(pn)!r} is used in one step by F.linear on rows gathered from the "
                    f"examples and otherwise (module {self.slot.name or '(root)'!r}), which are taken apart, "
                    "so the norm of their sum is not known"))
                continue
            if parts and (i is None) != (None in parts):
                s.unmeasured.setdefault(pn, (
                    f"parameter {s.full(pn)!r} is used in one step both whole and by its slices along dim 0 "
                    f"(module {self.slot.name or '(root)'!r}, {type(self.slot.module).__name__}), which are "
                    "taken apart, so the norm of their sum is not known"))
                continue
            if s is not self.slot and s.calls:
                s.unmeasured.setdefault(pn, (
                    f"parameter {s.full(pn)!r} is used both by calling its module and read directly by "
                    f"module {self.slot.name or '(root)'!r} ({type(self.slot.module).__name__}), and the two "
                    "per-example gradients are taken apart, so the norm of their sum is not known"))
                continue
            if gram:                                   # (rows: the Gram form, no gradient formed)
                parts[i] = self.grams.setdefault(key, row_grams.RowGrams(B)).add(v)
                norms.setdefault(s, {})[pn] = parts[i] if len(parts) == 1 else \
                    torch.stack(list(parts.values())).sum(0)
                continue
            v = v.to(kernels.acc_dtype(v.dtype))
            have = self.acc.pop(key, None) if last else self.acc.get(key)
            if have is not None and have.shape != v.shape:
                raise RuntimeError(f"parameter {s.full(pn)!r} was broadcast over batches of sizes "
                                   f"{have.shape[0]} and {v.shape[0]} in one step: its per-example gradient "
                                   "needs every use to see the same examples along dim 0")
            total = v if have is None else have + v
            if not last:
                self.acc[key] = total
            parts[i] = kernels.row_sq(total)
            norms.setdefault(s, {})[pn] = parts[i] if len(parts) == 1 else \
                torch.stack(list(parts.values())).sum(0)
        if last:                                       # (every use has come: the others' sums too)
            self.acc.clear()
            self.grams.clear()
        for s, got in norms.items():
            s.record(got, B)


def _by_rows(grads, kept: list, n: int, rows: tuple, g: torch.Tensor, roles: tuple | None) -> list:
    """(B, *shape) per-example gradients of the ``n`` followed weights in ``kept``, each example's from its
    rows alone (``rows``: the example of each row of the op's input and output, and B): F.linear's by its
    products, ∇W ℓ_b = Σ_{r of b} g_r x_rᵀ and ∇b ℓ_b = Σ_{r of b} g_r (``roles``), else the vjp ``grads``.
    The rows are sorted by example once (one host read: how many each has)."""
    ex, B = rows
    order, counts = row_grams.by_example(ex, B)
    xs, g = [x[order] for x in kept[n:]], g[order]
    per = [torch.empty((B, *w.shape), dtype=kernels.acc_dtype(w.dtype), device=w.device) for w in kept[:n]]
    with torch._C.DisableTorchFunctionSubclass():
        start = 0
        for b, c in enumerate(counts):
            if not c:                                   # (an example none of whose rows came here)
                for p in per:
                    p[b] = 0
            else:
                at = slice(start, start + c)
                if roles is not None:                   # (written in place: no copy of G_b)
                    gb, xb = g[at].to(per[0].dtype), xs[0][at].to(per[0].dtype)
                    for p, r in zip(per, roles):
                        torch.mm(gb.t(), xb, out=p[b]) if r == "weight" else torch.sum(gb, 0, out=p[b])
                else:
                    for p, v in zip(per, grads(*(x[at] for x in xs), g[at])):
                        p[b] = v
            start += c
    return per


def _gram_uses(kept: list, fol: list, roles: tuple, rows: tuple, g: torch.Tensor) -> list | None:
    """F.linear on rows gathered from the examples, its weight and bias followed as themselves or as slices
    (``p[i]``): the weight's use as its rows (:class:`~.row_grams.RowsUse`, for the Gram form), the bias's
    as per-example sums, (B, out); None where the Gram form is not the cheaper or a followed tensor is made
    from its parameter otherwise (then the per-example products are formed)."""
    if any(f._root is None and f._slice is None for f in fol):
        return None
    ex, B = rows
    order, counts = row_grams.by_example(ex, B)
    acc = kernels.acc_dtype(g.dtype)
    X, D = kept[len(fol)][order].to(acc), g[order].to(acc)
    if not row_grams.takes(X, D, counts):
        return None
    uses = []
    for f, r in zip(fol, roles):
        if r == "weight":
            uses.append((f, row_grams.RowsUse(X, D, counts)))
        else:
            uses.append((f, torch.zeros(B, D.shape[1], dtype=acc, device=D.device).index_add_(
                0, ex[order], D)))
    return uses


def _linear_roles(func, args: tuple, kwargs: dict, fol: list) -> tuple | None:
    """("weight" | "bias" for each followed tensor) where ``func`` is F.linear on a 2-D input whose weight
    and bias are all that is followed, else None."""
    import torch.nn.functional as F
    if func is not F.linear or len(args) < 2 or args[0].dim() != 2:
        return None
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    roles = tuple("weight" if f is args[1] else "bias" if f is bias else None for f in fol)
    return None if None in roles else roles


class _SliceOf:
    """``root[i]`` as :meth:`Step.add` reads a followed slice."""
    __slots__ = ("_slice",)
    _root = None

    def __init__(self, root, i: int):
        self._slice = (root, i)


class _Hole:
    """Where an op's argument goes in its per-example re-run (:meth:`Step.through`)."""
    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _to_params(slot, root: tuple, v: torch.Tensor) -> dict:
    """{(slot, param): (B, *shape)} of a root's per-example gradient ``v``: a bare parameter's own, a
    child's parameter read directly (its slot's), a layer's call mapped back through the layer."""
    if root[0] == "param":
        return {(slot, root[1]): v}
    if root[0] == "child":
        return {(root[1], root[2]): v}
    return {(slot, pn): w for pn, w in _layer_vjp(root, v).items()}


def _names(f: Followed) -> list[tuple]:
    """The (slot, parameter) pairs a followed tensor comes from."""
    roots, slot = ((f,) if f._root is not None else f._roots), f._step.slot
    return list(dict.fromkeys(pair for r in roots for pair in (
        ((slot, r._root[1]),) if r._root[0] == "param" else ((r._root[1], r._root[2]),)
        if r._root[0] == "child" else tuple((slot, pn) for pn in r._root[4]))))


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
