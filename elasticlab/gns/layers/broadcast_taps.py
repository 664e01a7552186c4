"""The taps of :mod:`elasticlab.gns.layers.broadcast_params`: where a followed tensor is broadcast over the
batch, a hook on the broadcast takes each example's gradient of it, maps it back to the parameters it was
made from (a batched vjp), and sums a step's uses (:class:`Step`). Expanded to rows that fold the batch with
windows or positions (:class:`Rows`), each example's rows are summed first.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from elasticlab.gns import kernels

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
    __slots__ = ("R", "fold", "cancelled", "open")

    def __init__(self, R: int, fold=None):
        self.R, self.fold, self.cancelled, self.open = R, fold, False, False


class Step:
    """One slot's per-example gradients of its followed parameters in the current step (``slot.follow``):
    its bare parameters, or, for a covered layer called without the batch, its own parameters."""

    def __init__(self, slot, layer: bool = False):
        self.slot, self.layer = slot, layer
        self.batch: int | None = None
        self.acc: dict[str, torch.Tensor] = {}        # {param: (B, *p.shape)} summed so far
        self.open = 0                                  # taps of the forward whose gradient has not come
        self.calls = 0                                 # (a layer) its calls without the batch this step
        self.shape: tuple = ()                         # (a layer) the output of its last such call

    def reset(self) -> None:
        """At each step's start (PerSampleGradNorms' forward pre-hook)."""
        self.batch, self.acc, self.open, self.calls = None, {}, 0, 0

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
        for pn in _names(f):
            slot.unmeasured.setdefault(pn, (
                f"module {mod} ran without the batch (its output has shape {self.shape}, the batch "
                f"{self.batch}), and that output {how}; expand its input over the batch, e.g. "
                "pos.unsqueeze(0).expand(B, -1)") if self.layer else
                f"bare parameter {slot.full(pn)!r} of module {mod} {how}")

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

    def cancel(self, fol: list) -> None:
        """The expansions to rows of the tensors made from ``fol`` whose layout is not yet known: their
        result is used otherwise (and followed as such), so their taps take nothing."""
        for f in fol:
            for r in f._pending:
                if r.fold is None and not r.cancelled:
                    r.cancelled = True
                    self.open -= r.open

    def _take(self, f: Followed, shape: tuple, g: torch.Tensor, rows: Rows | None = None) -> None:
        if rows is not None and rows.cancelled:
            return
        self.open -= 1
        if rows is not None:
            if rows.fold is None:
                self.refuse(f, "an op that never met the batch its rows fold", folded=True)
                return
            g = rows.fold.sum_rows(g)                  # (R, …) → (B, …): each example's rows
        B = g.shape[0]
        pe = g.detach().reshape(B, *shape)
        slot = self.slot
        if f._root is not None:
            at = [(f._root, pe)]
        else:                                          # made from its roots by other ops: their vjp, each
            with torch._C.DisableTorchFunctionSubclass(), torch.enable_grad():    # example's (no hook of a
                got = torch.autograd.grad(f, list(f._roots), pe, retain_graph=True,   # parameter runs: the
                                          allow_unused=True, is_grads_batched=True)  # roots are aliases)
            at = [(r._root, v) for r, v in zip(f._roots, got) if v is not None]
        per: dict[str, torch.Tensor] = {}
        for root, v in at:              # a parameter's alias: its own gradient; a layer's output: its vjp
            for pn, w in (_layer_vjp(root, v) if root[0] == "call" else {root[1]: v}).items():
                per[pn] = w if pn not in per else per[pn] + w
        last = self.open <= 0                          # the step's last use: nothing more to hold
        norms = {}
        for pn, v in per.items():
            v = v.to(kernels.acc_dtype(v.dtype))
            have = self.acc.pop(pn, None) if last else self.acc.get(pn)
            if have is not None and have.shape != v.shape:
                raise RuntimeError(f"bare parameter {slot.full(pn)!r} was broadcast over batches of sizes "
                                   f"{have.shape[0]} and {v.shape[0]} in one step: its per-example gradient "
                                   "needs every use to see the same examples along dim 0")
            total = v if have is None else have + v
            if not last:
                self.acc[pn] = total
            norms[pn] = kernels.row_sq(total)
        slot.record(norms, B)


def _names(f: Followed) -> list[str]:
    """The parameters a followed tensor comes from."""
    roots = (f,) if f._root is not None else f._roots
    return list(dict.fromkeys(pn for r in roots for pn in
                              ((r._root[1],) if r._root[0] == "param" else r._root[4])))


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
