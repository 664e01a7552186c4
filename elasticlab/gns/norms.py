"""``PerSampleGradNorms``: per-example gradient norms of a model, from layer inputs and output gradients.

Inside the context, after ``loss.backward()``, ``sq_norms()`` is ‖∇θ ℓ_i‖² (B,) over all trainable
parameters, where the loss is (1/B)·Σ ℓ_i (``"mean"``) or Σ ℓ_i (``"sum"``) over the batch dimension (dim 0
of each layer's input). Per-example gradients are never materialised for the whole batch (McCandlish et al.
App. A.1 needs only their norms). ``fused=True`` lets the layers whose rule has a fused form (Linear, Conv,
LayerNorm, …; :mod:`elasticlab.gns.layers`) form their parameter gradients and norms in one backward; other
layers, and all with ``fused=False``, use hooks.

Mixed precision: under ``torch.autocast`` the norms are accumulated and returned in float32; a
``grad_scaler``'s loss scale is divided out (overflowed float16 steps: non-finite norms, skipped and counted).
Coverage guard: the norms come from the modules' calls, so a covered parameter used without calling its
module (``F.linear(x, self.lin.weight)``; an unregistered container that uses a child's weight directly) would
be silently missing from the sum. After each forward of the model, the parameters of the covered modules that
did not run get a one-shot post-accumulate-grad hook; one that fires means the loss depended on a parameter
whose per-example norm nobody recorded. Reading the results then raises (``strict``) naming the module, or
leaves the parameter out of the norms *and* of :meth:`grad_sq_norm`, lists it in ``left_out`` and warns once.
Modules that ran cost nothing. Tied weights: an embedding's table that is a Linear's weight (GPT-2) gets the
norm of its summed gradient (:mod:`~elasticlab.gns.tied`); another parameter two covered modules share is
refused like an uncovered one. Not detected: a parameter used by its module and directly (F.linear(x, w)).
Activation checkpointing (``torch.utils.checkpoint``, reentrant or not): a layer recomputed in the backward
is one call; the fused forms' saved tensors are recomputed, and so are a hook rule's layer inputs (packed by
the active saved-tensor hooks, ``capture.kept``; ``save_on_cpu`` offloads them too). A module
called several times in one forward gets the norm of its gradient summed over the calls (gns.repeated).
``torch.compile``: the model may be compiled (``torch.compile(model)``, this context on ``model``); what
only an eager forward shows (a batch-less positional embedding's broadcast, a module called several times,
rows that fold the batch) is learned in one eager step and reused by the compiled steps after it; the first
training step runs eagerly for that (``eager_first``), and with ``eager_first=False`` such calls are
refused by name until an eager step of ``model``.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from elasticlab.gns import folds, hooks, loss_scale, repeated, sharded
from elasticlab.gns import layers as _layers  # noqa: F401  (registers the rules)
from elasticlab.gns.block import NormBlock
from elasticlab.gns.broadcast import Audit
from elasticlab.gns.capture import batched_input, frozen, now_training
from elasticlab.gns.eager_first import EagerFirst
from elasticlab.gns.forwards import Forwards
from elasticlab.gns.layers import bias_method
from elasticlab.gns.layers.common import EagerUnderCompile
from elasticlab.gns.sink import Sinks
from elasticlab.gns.slot import (
    GradSquares,
    Slot,
    finish,
    grad_squares,
    layer_totals,
    left_out_why,
    recomputing,
    slots_of,
    stacked_total,
    unmeasured,
    unrecorded,
)
from elasticlab.gns.tied import untie


class PerSampleGradNorms:
    """Context manager measuring per-example squared gradient norms of ``model``.

    ``strict``: a trainable parameter no rule covers, or one two covered modules share other than an
    embedding tied to a Linear (:mod:`~elasticlab.gns.tied`), is a ValueError naming it; with
    ``strict=False`` it is left out and listed in ``skipped``. Frozen parameters are always skipped. A
    covered parameter that the loss depended on although its module never ran (see the module docstring)
    makes the readers raise a RuntimeError naming the module (``strict``), or is left out and listed in
    ``left_out`` with a warning.
    ``grad_scaler``: the ``torch.amp.GradScaler`` whose scaled loss is backpropagated (its scale is read,
    without a host sync, at each forward and divided out of the results). ``eager_first``: the first
    training step runs eagerly, compiled models too (:mod:`~elasticlab.gns.eager_first`).
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", strict: bool = True,
                 fused: bool = True, grad_scaler=None, eager_first: bool = True):
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"PerSampleGradNorms needs an nn.Module, got {type(model).__name__}")
        if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self.model, self.loss_reduction, self.strict, self.fused = model, loss_reduction, strict, fused
        self.grad_scaler = grad_scaler
        self._scale: torch.Tensor | None = None           # the loss scale of the current step
        self._batch: int | None = None                    # dim 0 of the model's input this step
        self._input_shape: tuple | None = None            # and its shape
        self.skipped: list[str] = []
        self._warned: set[tuple[str, ...]] = set()
        self._slots: list[Slot] = slots_of(self, model, strict, self.skipped)
        self._ties = untie(self._slots, strict, self.skipped)     # one parameter, two modules (gns.tied)
        self._frozen = frozen(model)                       # checked at each read (now_training)
        tied = {id(m) for t in self._ties for m in t.members}             # (they may need nothing)
        self._slots = [s for s in self._slots if s.need or s.rule.calls_children or id(s) in tied]
        self._trained = [(s, pn, s.module._parameters[pn]) for s in self._slots for pn in s.need]  # frozen?
        self._handles, self._probes = [], []   # (probes: one-shot hooks on the unrun modules of a step)
        self._layer_cache: dict[str, torch.Tensor] | None = None   # layer_sq_norms of this step, once read
        self._covered: set[tuple[int, str]] | None = None   # the coverage check, within reading()
        self._factors: dict[tuple, torch.Tensor] = {}     # B² as 0-dim CPU tensors, by (B², dtype)
        self._patched: list[tuple[nn.Module, object]] = []
        self._bufs: list[torch.Tensor] | None = None       # slots' own C++-backward buffers, reset each step
        for i, s in enumerate(self._slots):
            s.index, s.tp = i, sharded.tensor_parallel(model, s)
        self._block = NormBlock(self._slots)               # the C++ backwards' rows: one reset, one read
        self._sinks = Sinks([s for s in self._slots if s.need])   # norms out of compiled backwards
        self._audit = Audit()                              # layers broadcast over the batch (gns.broadcast)
        self._forwards = Forwards()                        # several forwards, one backward (gns.forwards)
        self._repeated = False                             # some module ran twice in a step (gns.repeated)
        self._unfuse: set[int] = set()                     # fused slots found repeated: hooks next step
        self._steps, self._watch = 0, False                # forwards begun; the first keeps fused calls
        self._eager_first = EagerFirst(eager_first)
        self._active = False

    # ------------------------------------------------------------------------------------------ hooks
    def _begin_step(self, module=None, args=(), kwargs=None):
        """At each forward of the model, run eagerly (``__enter__``); not at its recomputation in a backward
        (activation checkpointing of the whole model), nor at a forward without gradients (an evaluation
        between a backward and the read of its norms)."""
        if module is not None and (recomputing() or not torch.is_grad_enabled()):
            return                                         # (an evaluation leaves the last step's norms)
        self._layer_cache = None
        self._steps += module is not None                  # (the model's forwards that train)
        if self._steps > 1:
            self._eager_first.release(True)                # (this one began eagerly: compiled from the next)
        self._watch = self._steps <= 1                     # the first keeps fused calls: gns.repeated.watch
        if self._unfuse:
            repeated.to_hooks(self)
        for s in self._slots:
            s.calls, s.fwd_calls, s.norms, s.on_block, s._sink_batch = 0, 0, {}, False, 0
            if s.touched:
                s.touched = set()
            if s.pending or s.spoiled or s.mixed or s.unmeasured or s.watched:
                s.pending, s.spoiled, s.mixed, s.unmeasured, s.watched = [], None, False, {}, []
            if s.follow is not None:
                s.follow.reset()
        if self._probes:
            self._drop_probes()
        self._block.begin()
        if self._bufs is None:
            self._bufs = [s.buf for s in self._slots if s.buf is not None and not s._in_block]
        if self._bufs:                                     # NaN until this step's backward writes them
            torch._foreach_mul_(self._bufs, float("nan"))
        x = batched_input(args, kwargs)                    # (its shape: .layers.expand_plan's rows)
        self._input_shape = None if x is None else tuple(x.shape)
        self._batch = None if x is None else int(x.shape[0])
        self._scale = loss_scale.current(self.grad_scaler)
        self._sinks.ready(args, kwargs)                    # (and forgets the last step's gradient)
        self._audit.begin(args, kwargs)
        self._forwards.begin()

    def micro_batch(self, batch_size: int | None = None) -> None:
        """A fresh slate, as the model's forward gives, for a micro-batch whose forward is not the model's (a
        LightningModule's ``training_step`` calling a submodule); ``batch_size``: what the output of a layer
        whose input shows no batch (a positional embedding on ``arange(T)``) is broadcast to."""
        if not self._active:
            raise RuntimeError("PerSampleGradNorms.micro_batch() outside its context: call it inside `with`")
        self._begin_step()
        if batch_size is not None and self._batch is None:
            self._batch = int(batch_size)

    @property
    def active(self) -> bool:
        """Inside the context (its hooks on the model)."""
        return self._active

    @property
    def tensor_parallel(self) -> dict[str, dict]:
        """{module name: its parameters' layouts} of the tensor-parallel layers (sharded.tensor_parallel)."""
        return {s.name: s.tp for s in self._slots if s.tp}

    def _drop_probes(self) -> None:
        for h in self._probes:
            h.remove()
        self._probes = []

    def _end_forward(self, module, args, output):
        """After the model's forward: the broadcast audit (gns.broadcast); a one-shot probe on each needed
        parameter of a module that did not run (or whose norms come from taps on followed tensors), noting
        (no host sync) whether the backward writes its grad.
        Not after a recomputation in a backward, nor after a forward without gradients."""
        if recomputing() or not torch.is_grad_enabled():
            return
        self._audit.end(output)
        self._forwards.end(output)
        if self._watch:
            repeated.release(self._slots)
        for s in self._slots:
            s.fwd_calls = s.calls
            # probed too: the followed parameters, whose norms come from taps (layers.broadcast_params) that
            # a use the following missed would leave unfired; in the first step, every one (a hook on an
            # output whose gradient an in-place op on a view of it reroutes never fires)
            if s.calls == 0 or self._watch or s.rule.sums_calls or s.follow is not None and s.follow.calls:
                for pname in s.need:
                    p = getattr(s.module, pname, None)
                    if isinstance(p, torch.Tensor) and p.requires_grad:
                        self._probes.append(p.register_post_accumulate_grad_hook(
                            lambda _, s=s, pname=pname: s.touched.add(pname)))

    def _left_out(self) -> list[tuple[Slot, str]]:
        """(slot, parameter) pairs the loss depended on in the last step with no norm of them recorded."""
        return [(s, pn) for s in self._slots if s.touched for pn in sorted(s.touched)
                if pn not in s.norms and pn not in s.unmeasured]        # (those refused for their own why)

    @property
    def left_out(self) -> list[str]:
        """Covered parameters of the last step that the loss depended on but whose module never ran (and so
        have no per-example norm), then those used in a way their rule could not measure (a bare parameter
        not broadcast over the batch, :mod:`.layers.broadcast_params`); they are not in the results
        (``strict=False``) or make them raise."""
        odd = [s.full(pn) for s in self._slots for pn in s.unmeasured]
        return [s.full(pn) for s, pn in self._left_out()] + odd

    def _check_coverage(self) -> set[tuple[int, str]]:
        """Raises the broadcast audit's error or that of several forwards, if any; raises (strict) or warns
        once about :attr:`left_out`; returns {(slot id, param)} to leave out. First, the norms of the modules
        that ran several times (gns.repeated)."""
        if self._covered is not None:
            return self._covered
        self._eager_first.release(True)                    # (a step was read: compiled from the next)
        if self._repeated:
            repeated.settle(self._slots)
        sharded.reduce_norms(self._slots)                  # (tensor-parallel layers: their shards' summed)
        for err in (self._audit.error, self._forwards.error):
            if err is not None:
                raise err
        late = now_training(self._frozen)
        if late:
            self._refuse(late, f"{list(late)} were frozen when PerSampleGradNorms was made and train now, so "
                         "no rule records their per-example norms", "Make PerSampleGradNorms (or GNSMonitor) "
                         "again after changing which parameters train", "the per-example norms and of "
                         "grad_sq_norm (they were never covered)")
        gone = [(s, pn) for s, pn, p in self._trained if not p.requires_grad]
        if gone:                                           # (progressive freezing) never with stale rows
            names = tuple(s.full(pn) for s, pn in gone)
            self._refuse(names, f"{list(names)} trained when PerSampleGradNorms was made and are frozen now",
                         "Make PerSampleGradNorms again after changing which parameters train (GNSMonitor "
                         "follows such a change by itself), or pass strict=False to leave them out",
                         "the per-example norms and of grad_sq_norm")
            for s, pn in gone:
                s.norms.pop(pn, None)
                s.on_block = False                         # (the block's sum would hold its row)
        odd, lost = unmeasured(self._slots, self._refuse), self._left_out()
        odd |= {(id(s), pn) for s, pn in gone}
        if not lost:
            return odd
        names, why = tuple(s.full(pn) for s, pn in lost), left_out_why(lost)
        self._refuse(names, why, "Call the module, register a rule for the parent that uses them, freeze "
                     "them, or pass strict=False to leave them out (listed in left_out)",
                     "the per-example norms and of grad_sq_norm (PerSampleGradNorms.left_out)")
        return odd | {(id(s), pn) for s, pn in lost}

    @contextlib.contextmanager
    def reading(self):
        """Several readers of one backward's norms (no backward in between): the coverage check once (an
        inner ``reading()`` uses the outer one's)."""
        if self._covered is not None:
            yield self
            return
        self._covered = self._check_coverage()
        try:
            yield self
        finally:
            self._covered = None

    def _refuse(self, names: tuple[str, ...], why: str, fix: str, left: str) -> None:
        """Parameters the norms miss: a RuntimeError saying ``why`` and ``fix`` (``strict``), else one warning
        per set of ``names`` that they are left out of ``left``."""
        if self.strict:
            raise RuntimeError(f"{why}. {fix}")
        if names not in self._warned:
            self._warned.add(names)
            warnings.warn(f"{why}; they are left out of {left}", RuntimeWarning, stacklevel=4)

    def __enter__(self) -> PerSampleGradNorms:
        if self._active:
            raise RuntimeError("PerSampleGradNorms is already active")
        # eager, never traced (a frame of its own, or a break in an enclosing compiled function): loads Dynamo
        eager = torch.compiler.disable
        EagerUnderCompile.prepare()
        self._handles.append(self.model.register_forward_pre_hook(eager(self._begin_step), with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(eager(self._end_forward)))
        for s in self._slots:
            fused_only = s.rule.norms is None
            fwd = (s.rule.fused(s.module, s) if (self.fused or fused_only) and s.rule.fused and not (
                   s.shared and not fused_only or s.tp)  # (repeated, tensor-parallel: hooks) its _parameters:
                   and not parametrize.is_parametrized(s.module) else None)
            if fwd is None and fused_only:
                self.__exit__()
                raise ValueError(f"module {s.name!r} ({type(s.module).__name__}): its rule has only a fused "
                                 "form, which does not support this configuration")
            s.fused = fwd is not None
            if fwd is not None:
                fwd = folds.unfolding(s, fwd) if s.rule.folds else fwd
                self._patched.append((s.module, s.module.__dict__.get("forward")))
                s.module.forward = self._audit.wrap(s, fwd)
            else:
                self._handles.append(hooks.install(self, s))
        self._unfuse.clear()                              # (the slots found repeated took hooks above)
        self._handles += bias_method.install(self)        # (T5's compute_bias: its bias over the batch)
        for t in self._ties:                              # the embeddings' indices, for the output layer
            self._handles += [e.module.register_forward_pre_hook(eager(t.pre_hook), with_kwargs=True)
                              for e in t.embs]
        self._active = True
        self._eager_first.hold()
        self._begin_step()
        return self

    def __exit__(self, *exc) -> None:
        self._eager_first.release(self._steps > 0)
        self._drop_probes()
        for h in self._handles:
            h.remove()
        for mod, old in self._patched:
            if old is None:
                del mod.forward
            else:
                mod.forward = old
        self._handles, self._patched, self._active = [], [], False

    # ------------------------------------------------------------------------------------------ results
    def param_sq_norms(self) -> dict[str, torch.Tensor]:
        """{parameter name: (B,)} per-example squared gradient norms of the last backward."""
        self._check_coverage()
        names, vals, slots = [], [], []
        for s in self._slots:
            for pname, v in s.norms.items():
                names.append(s.full(pname))
                vals.append(v)
                slots.append(s)
        return dict(zip(names, finish(self, vals, slots)))

    def layer_sq_norms(self) -> dict[str, torch.Tensor]:
        """{module name: (B,)}: per-example squared norms of each module's own trainable parameters."""
        self._check_coverage()
        if self._layer_cache is None:
            slots = [s for s in self._slots if s.norms]
            self._layer_cache = dict(zip((s.name for s in slots), finish(self, layer_totals(slots), slots)))
        return dict(self._layer_cache)

    def sq_norms(self) -> torch.Tensor:
        """(B,) per-example ‖∇θ ℓ_i‖² over all covered trainable parameters, of the last backward. Read
        after a forward whose backward has not run, the fused layers' rows are still NaN (they are filled by
        the backward, with no host synchronisation to tell): every example is then NaN, which the estimators
        skip and count."""
        fast = self._sq_norms_at_once()
        if fast is not None:
            return fast
        layers = self.layer_sq_norms()
        if not layers and self._batch and any(s.calls for s in self._slots):   # (compiled: no rows to be NaN)
            return torch.full((self._batch,), float("nan"), device=self._sinks.device)   # (the input's)
        if not layers:
            raise RuntimeError("no per-example norms recorded: run forward and loss.backward() inside the "
                               "context")
        vals = list(layers.values())
        same = len(vals) > 1 and vals[1].dtype == vals[0].dtype and vals[1].device == vals[0].device
        total = vals[0] + vals[1] if same else vals[0].clone()      # = clone then += (no extra copy)
        for v in vals[1 + same:]:
            total += v
        return total

    def _sq_norms_at_once(self) -> torch.Tensor | None:
        """The common case of :meth:`sq_norms`: one launch from the shared block (:meth:`NormBlock.read`,
        without a loss scale), or three (:func:`~elasticlab.gns.slot.stacked_total`); else None."""
        self._check_coverage()
        fast = self._block.read() if self._scale is None else None
        if fast is None and self._scale is None:
            fast = self._sinks.read()
        return fast if fast is not None else stacked_total(self._slots, self._scale)

    def grad_squares(self) -> GradSquares:
        """The covered parameters' Σ g² of ``.grad`` as it is now (before a clipping or ``unscale_`` changes
        it), left on the devices: no host read, no collective, until :meth:`layer_grad_sq_norms` reads it."""
        unscaled = self._scale is None or loss_scale.unscaled(self.grad_scaler)
        return grad_squares(self._slots, self._check_coverage(), None if unscaled else self._scale)

    def grad_sq_norm(self, batch_size: int | None = None) -> float:
        """‖ḡ‖² of the batch-mean gradient from the covered parameters' ``.grad`` (which must hold this
        batch's gradient alone: zero them before the backward). With ``"sum"`` it divides by B²; with a
        ``grad_scaler`` it divides out the loss scale unless ``scaler.unscale_`` already did."""
        return sum(self.layer_grad_sq_norms(batch_size).values())

    def layer_grad_sq_norms(self, batch_size: int | None = None,
                            squares: GradSquares | None = None) -> dict[str, float]:
        """{module name: ‖ḡ‖²} per module, as :meth:`grad_sq_norm` (for per-layer GNS), of ``squares``
        (:meth:`grad_squares`, taken earlier) or of ``.grad`` now. A nonzero gradient of a parameter whose
        module ran but recorded no norm of it raises (``strict``) or is left out, with one warning."""
        sums, missed, div = (squares or self.grad_squares()).read()
        if missed and any(s.norms or s.on_block for s in self._slots):   # (none: a forward, no backward yet)
            self._refuse(tuple(s.full(pn) for s, pn in missed), unrecorded(missed), "Freeze them, give the "
                         "module a rule that covers them, or pass strict=False to leave them out",
                         "grad_sq_norm as well")
        if self.loss_reduction == "sum":
            div *= float(batch_size if batch_size is not None else self.sq_norms().shape[0]) ** 2
        return {s.name: sum(row) / div for s, row in zip(self._slots, sums)}
