"""``GNSMonitor``: the gradient noise scale of an existing training loop, estimator chosen by itself.

    monitor = GNSMonitor(model)
    for x, y in loader:
        opt.zero_grad()
        with monitor.step():                       # forward(s) and backward(s) of one optimizer step
            loss_fn(model(x), y).backward()
        opt.step()
    monitor.b_simple, monitor.history

Which form of McCandlish et al.'s App. A.1 estimator (:mod:`~elasticlab.gns.forms`) each measured step
uses (``method="auto"``):
- ``"replica"``: ``model`` is a ``DistributedDataParallel`` over >= 2 processes: each replica's local
  gradient ‖g_r‖² (taken before the averaging by :class:`~elasticlab.gns.ddp.ReplicaGradNorms`, a DDP comm
  hook) against the all-reduced one; B_small = local batch, B_big = global batch.
- ``"micro_batch"``: several backwards in one step (gradient accumulation): each micro-batch's ‖h_k‖²
  (tensor hooks see the gradient before it is added to ``.grad``) against the accumulated one.
- ``"per_example"``: one backward on one process: per-example norms (:class:`PerSampleGradNorms`); on an
  initialised group with a plain (not DDP) model, the per-example sums are all-reduced; under FSDP2, every
  micro-batch's (:mod:`~elasticlab.gns.sharded`). After a step of several backwards they are off (their cost
  saved) until a step of one, which goes unmeasured, turns them on again from the next.

Gradients are read at the end of each backward (:class:`~elasticlab.gns.capture.StepGradients`): clipping
after it changes nothing. A ``grad_scaler``'s loss scale is divided out; an overflowed step's non-finite
norms are skipped and counted (``skipped``). Under ``torch.autocast`` the norms are float32.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn

from elasticlab.checks import whole
from elasticlab.gns import ddp as _ddp
from elasticlab.gns import forms, loss_scale, sharded
from elasticlab.gns.capture import StepGradients, batch_of, frozen, now_training
from elasticlab.gns.estimator import GNSEstimator
from elasticlab.gns.forms import check_settings
from elasticlab.gns.norms import PerSampleGradNorms
from elasticlab.gns.slot import recomputing

_check_size = functools.partial(whole, "batch_size", least=1, need="an integer >= 1")


class GNSMonitor:
    """Measures B_simple, ‖G‖² and tr Σ (McCandlish Eqs. 2.9, A.1) of ``model`` every ``every`` steps.

    ``accumulation``: ``"mean"`` when each micro-batch's loss is divided by the number of micro-batches
    (Lightning, HF Trainer), ``"sum"`` when not. ``loss_reduction``: how each batch's loss reduces over
    its examples (per-example form). ``per_layer``: keep per-module estimates (per-example and micro-batch
    forms). ``beta`` and ``init_batch_size``: the :class:`GNSEstimator`'s. ``history``: one dict per measured
    step (``step``, ``b_simple``, ``grad_sq``, ``trace_cov``, ``batch_size``, ``micro_batches``, ``method``,
    ``skipped``, and ``layers`` {module: B_simple} with ``per_layer``). ``process_group``: the processes whose
    examples differ (default: all; with tensor-parallel layers, read off their meshes by every process
    together: :func:`~elasticlab.gns.sharded.data_parallel_group`).
    """

    def __init__(self, model: nn.Module, every: int = 1, beta: float = 0.99, method: str = "auto",
                 grad_scaler=None, per_layer: bool = True, accumulation: str = "mean",
                 loss_reduction: str = "mean", init_batch_size: int = 1, process_group=None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"GNSMonitor needs an nn.Module, got {type(model).__name__}")
        every = check_settings(every, beta, method)
        sharded.refuse_unsupported(model)
        if accumulation not in ("mean", "sum"):
            raise ValueError(f"accumulation must be 'mean' or 'sum', got {accumulation!r}")
        if loss_reduction not in ("mean", "sum"):     # (else 'auto' would take it for norms unavailable)
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self.model, self.every, self.method = model, every, method
        self.grad_scaler, self.per_layer, self.accumulation = grad_scaler, per_layer, accumulation
        self.group = process_group
        self.estimator = GNSEstimator(beta=beta, init_batch_size=init_batch_size)
        self.history: list[dict] = []
        self.steps = 0                        # steps begun
        self.unmeasured = 0                   # measured steps that gave no estimate (e.g. one micro-batch)
        is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.module = model.module if is_ddp else model
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(process_group) if on else 1
        self._replicas = None
        if method == "replica" or (method == "auto" and is_ddp and self.world > 1):
            if not (is_ddp and self.world > 1):
                raise ValueError("method='replica' needs a DistributedDataParallel model over >= 2 processes "
                                 f"(got {type(model).__name__}, world size {self.world})")
            try:
                self._replicas = _ddp.ReplicaGradNorms(model, process_group)
            except RuntimeError as e:
                raise RuntimeError(f"GNSMonitor could not register its DDP communication hook ({e}); a DDP "
                                   "model takes one hook: remove yours, or use method='per_example'") from e
        self._loss_reduction = loss_reduction
        self._accumulating = False            # auto: a step had several backwards, per-example norms unused
        self._track()
        if process_group is None and self.world > 1 and self._psn is not None and self._psn.tensor_parallel:
            self.group = sharded.data_parallel_group(self._psn.tensor_parallel.values())  # (examples differ)
            self.world = dist.get_world_size(self.group)
        self._root = self.module.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        self._out = [m.register_forward_hook(torch.compiler.disable(self._on_output))  # FSDP2: backwards
                     for m in (sharded.watched(self.module) if self._sharded else ())]    # seen at outputs
        self._open = self._measuring = self._fixed_size = self._warned_syncs = False
        self._reset_step()

    # ------------------------------------------------------------------------------------------ steps
    def _track(self) -> None:
        """Follow the parameters that train now: their per-example norms (:class:`PerSampleGradNorms`) and
        each backward's gradient norms (:class:`~elasticlab.gns.capture.StepGradients`)."""
        self._psn, self._psn_error = None, None       # (why not: PerSampleGradNorms says, e.g. tied weights)
        if self.method == "per_example" or (self.method == "auto" and self._replicas is None):
            try:
                self._psn = PerSampleGradNorms(self.module, loss_reduction=self._loss_reduction,
                                               grad_scaler=self.grad_scaler)
            except ValueError as e:
                if self.method == "per_example":
                    raise
                self._psn_error = str(e)
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("GNSMonitor: the model has no trainable parameters")
        self._params, self._named = [p for _, p in named], named
        self._sharded = sharded.is_sharded(self._params)
        if self._sharded and (self.method == "micro_batch" or self._psn is None):
            raise ValueError(sharded.PER_EXAMPLE_ONLY.format(self._psn_error or "method='micro_batch' asked"))
        self._frozen = frozen(self.module)    # unfrozen later: tracked again at begin()
        self._grads = StepGradients(self._params, self._after_backward)
        self._grads.read_grads = not self._sharded                # (FSDP2: the backwards counted only)
        self._groups = forms.layer_groups(forms.layer_of(named))

    def _reset_step(self) -> None:
        self._psn_snap, self._psn_rows = None, []     # (rows: FSDP2's, every micro-batch's per-example norms)
        self._psn_grad = None                 # FSDP2: each module's ‖.grad‖² after the last backward (unread)
        self._fwd_sizes: list[int] = []
        self._given_sizes: list[int] = []
        self._scale = None

    def is_measured(self, step: int | None = None) -> bool:
        """Whether step ``step`` (1-based; default the next one) is measured: 1, 1 + every, ..."""
        step = self.steps + 1 if step is None else step
        return (step - 1) % self.every == 0

    def _use_psn(self) -> bool:
        return self._psn is not None and not (self.method == "auto" and self._accumulating)

    def begin(self, batch_size: int | None = None) -> None:
        """Start one optimizer step (its forwards and backwards follow); ``batch_size`` is the size of each
        micro-batch, when the model's forward does not show it (dim 0 of its first tensor argument)."""
        if self._open:
            raise RuntimeError("GNSMonitor.begin() called twice without end(): one step at a time")
        late = now_training(self._frozen)
        gone = [n for n, p in self._named if not p.requires_grad]
        if late or gone:                      # gradual (un)freezing: a new parameter set, a new estimate
            what = "; ".join(f"{n} {v}" for n, v in ((list(late), "train now"), (gone, "are frozen now"))
                             if n)
            warnings.warn(f"GNSMonitor: {what}; measured from this step on, with the estimate restarted "
                          "(the GNS of another parameter set)", RuntimeWarning, stacklevel=2)
            self._track()
            self.estimator = GNSEstimator(beta=self.estimator.beta,
                                          init_batch_size=self.estimator.init_batch_size)
        self.steps += 1
        self._open, self._measuring = True, self.is_measured(self.steps)
        if not self._measuring:
            return
        try:
            self._reset_step()
            if self._replicas is not None:
                self._replicas.reset()        # its hook adds up every synchronised backward, measured or not
            self._fixed_size = batch_size is not None
            self._given_sizes = [_check_size(batch_size)] if self._fixed_size else []
            self._scale = loss_scale.current(self.grad_scaler)
            self._grads.read_first = not self._use_psn()      # per-example: the norms read .grad then
            self._grads.start()
            if self._use_psn():
                self._psn.__enter__()
        except BaseException:                 # (a bad batch_size): the step is not left open
            self.abort()
            raise

    def micro_batch(self, batch_size: int | None = None) -> None:
        """A micro-batch of this step starts (for loops whose forward of ``model`` is not called directly,
        as a LightningModule whose ``training_step`` calls a submodule): its size, and a fresh slate for the
        per-example norms."""
        if not (self._open and self._measuring):
            return
        if batch_size is not None:
            if self._fixed_size:
                self._given_sizes, self._fixed_size = [], False
            self._given_sizes.append(_check_size(batch_size))
        if self._use_psn() and self._psn.active:
            self._psn.micro_batch(batch_size)

    def _on_forward(self, module, args, kwargs):
        if self._open and self._measuring and torch.is_grad_enabled() and not recomputing():
            b = batch_of(args, kwargs)
            if b is not None:
                self._fwd_sizes.append(b)

    def _on_output(self, module, args, output):
        if self._open and self._measuring and torch.is_grad_enabled():
            self._grads.watch(output)

    def _after_backward(self) -> None:
        """End of one backward: the per-example norms of the first (more backwards: micro-batch form)."""
        if (self._grads.backwards == 1 or self._sharded) and self._use_psn() and self._psn.active:
            try:
                with self._psn.reading() as psn:
                    if self._sharded:
                        self._psn_rows.append((psn.sq_norms(), self.per_layer and psn.layer_sq_norms()))
                        self._psn_grad = psn.grad_squares()      # now, before any clipping: read at the end
                    else:
                        self._psn_snap = self._read_psn()
            except RuntimeError as e:
                self._psn_snap = e

    def _read_psn(self):
        psn = self._psn
        sq = psn.sq_norms()
        if self.per_layer:
            layers, lg = psn.layer_sq_norms(), psn.layer_grad_sq_norms(sq.shape[0])
            return sq, sum(lg.values()), {k: (layers[k], lg[k]) for k in layers}
        return sq, psn.grad_sq_norm(sq.shape[0]), None

    def end(self, step: int | None = None) -> dict | None:
        """Close the step opened by :meth:`begin`: fold its estimate; returns its ``history`` record (None
        for an unmeasured step). ``step`` names it in the record (default: steps begun so far)."""
        if not self._open:
            raise RuntimeError("GNSMonitor.end() without begin()")
        self.abort()                          # hooks off, step closed; its estimate is folded below
        if not self._measuring:
            return None
        k = self._grads.backwards
        if k == 0:
            rec = None
        elif self._replicas is not None:
            rec = self._fold_replicas(k)
        elif k == 1 or self._sharded:
            rec = self._fold_per_example(k)
        else:
            rec = self._fold_micro_batches(k)
        if rec is None:
            self.unmeasured += 1
            return None
        folded, batch, form, layers = rec
        out = {"step": self.steps if step is None else int(step), "b_simple": self.b_simple,
               "grad_sq": self.grad_sq, "trace_cov": self.trace_cov, "batch_size": batch,
               "micro_batches": k, "method": form, "skipped": not folded}
        if layers:
            lb = self.estimator.layer_b_simple()
            out["layers"] = {name: lb[name] for name in layers if name in lb}
        self.history.append(out)
        return out

    @contextlib.contextmanager
    def step(self, batch_size: int | None = None):
        """``with monitor.step(): ...`` = :meth:`begin` ... :meth:`end` around one optimizer step's
        forwards and backwards."""
        self.begin(batch_size)
        try:
            yield self
        except BaseException:
            self.abort()
            raise
        self.end()

    def abort(self) -> None:
        """Close an open step without folding it (its hooks removed)."""
        self._grads.stop()
        if self._psn is not None and self._psn.active:
            self._psn.__exit__()
        self._open = False

    # ------------------------------------------------------------------------------------------ forms
    def _scale_sq(self) -> float:
        return 1.0 if self._scale is None else float(self._scale) ** 2

    def _sizes(self, k: int) -> list[int]:
        """The k micro-batch sizes of this step: given ones, else the forwards' (the last k of them)."""
        given = self._given_sizes * k if self._fixed_size else self._given_sizes
        sizes = given if len(given) >= k else self._fwd_sizes
        if len(sizes) < k:
            raise ValueError(f"GNSMonitor: {k} backwards in this step but {len(sizes)} micro-batch sizes "
                             "known (the model's forward shows none): pass batch_size= to step()/begin(), or "
                             "call micro_batch(n) before each micro-batch")
        return sizes[-k:]

    def _weight(self, k: int) -> float:
        """Each micro-batch's loss weight w: its gradient is w·ḡ_k."""
        return 1.0 / k if self.accumulation == "mean" else 1.0

    def _fold_micro_batches(self, k: int):
        """Micro-batch form (:func:`~elasticlab.gns.forms.micro_batch`)."""
        self._accumulating = True                           # (auto: per-example norms off from now on)
        w2 = self._weight(k) ** 2 * self._scale_sq()
        small = self._grads.micro_sq() / w2                  # ‖ḡ_k‖², (k, P)
        big = self._grads.grad_sq() / (w2 * k * k)            # ‖ḡ‖² of the mean gradient, (P,)
        groups = self._groups if self.per_layer else {}
        folded, n = forms.micro_batch(self.estimator, small, big, self._sizes(k), groups, self.world,
                                      self.group)
        return folded, n, "micro_batch", (dict.fromkeys(groups) if self.per_layer else None)

    def _fold_per_example(self, k: int = 1):
        snap = self._psn_snap
        if isinstance(snap, RuntimeError):
            raise RuntimeError(f"GNSMonitor: no per-example norms for this step ({snap}); run the model's "
                               "forward inside the step: with monitor.step(): loss_fn(model(x), y).backward()"
                               ) from snap
        means = self._loss_reduction == "mean"
        if self._sharded:                     # FSDP2: over every micro-batch of the step
            w2, rows = self._weight(k) ** 2, self._psn_rows
            if len(rows) != k:
                raise RuntimeError(f"GNSMonitor: {k} backwards in this step but per-example norms for "
                                   f"{len(rows)}; run each micro-batch's forward inside the step")
            n = sum(r.numel() for r, _ in rows)
            div = w2 * (k * k if means else n * n)           # (the loss summed over examples: by n²)
            lg = {name: v / div for name, v in self._psn.layer_grad_sq_norms(1, self._psn_grad).items()}
            # a module of the rows' (one owning a tied weight counts it; one that did not run in a micro-batch
            # has no row there: zero per-example norms), not lg's (every module, those owning none with 0)
            names = dict.fromkeys(name for _, lr in rows for name in (lr or ()))
            layers = {name: ([lr[name] / w2 if name in lr else torch.zeros_like(r) for r, lr in rows],
                             lg[name]) for name in names}
            grad_sq = sum(lg.values())
            folded, n = forms.per_example(self.estimator, [r / w2 for r, _ in rows], grad_sq, means, layers,
                                          self.world, self.group)
            return folded, n, "per_example", layers
        if snap is None:
            if self._psn is None:
                raise RuntimeError(
                    "GNSMonitor: one backward per step on one process needs per-example gradient norms, but "
                    f"they are not available for this model ({self._psn_error}). Accumulate >= 2 "
                    "micro-batches per step (micro-batch form) or train under DDP (replica form)")
            self._accumulating = False        # (off after accumulation; one backward: on from the next step)
            return None
        sq, grad_sq, layers = snap
        layers = layers and {name: ([ln], lg) for name, (ln, lg) in layers.items()}
        folded, n = forms.per_example(self.estimator, [sq], grad_sq, means, layers, self.world, self.group)
        return folded, n, "per_example", layers

    def _fold_replicas(self, k: int):
        """Replica two-batch form (:meth:`~elasticlab.gns.ddp.ReplicaGradNorms.fold`)."""
        if self._replicas.syncs > 1:          # (every replica alike: DDP's all-reduces are collective)
            if not self._warned_syncs:
                warnings.warn(_ddp.SYNCED.format(self._replicas.syncs, k), RuntimeWarning, stacklevel=3)
            self._replicas.reset()
            self._warned_syncs = True
            return None
        div = self._weight(k) ** 2 * self._scale_sq() * k * k      # this replica's mean gradient: local/(w·k)
        big = self._grads.grad_sq() / div                          # .grad: DDP averaged the replicas
        layers = {n: float(big[c].sum()) for n, c in (self._groups if self.per_layer else {}).items()}
        rec = self._replicas.fold(self.estimator, div, sum(self._sizes(k)), float(big.sum()), layers)
        return rec and (*rec, "replica", layers or None)

    # ------------------------------------------------------------------------------------------ read-out
    @property
    def b_simple(self) -> float:
        """B_simple = tr Σ/‖G‖² (McCandlish Eq. 2.9), ratio of the estimator's EMAs."""
        return self.estimator.b_simple

    @property
    def grad_sq(self) -> float:
        return self.estimator.grad_sq

    @property
    def trace_cov(self) -> float:
        return self.estimator.trace_cov

    @property
    def skipped(self) -> int:
        """Measured steps whose norms were not finite (overflowed half-precision steps), not folded."""
        return self.estimator.skipped

    def layer_b_simple(self) -> dict[str, float]:
        return self.estimator.layer_b_simple()

    def state_dict(self) -> dict:
        return {"estimator": self.estimator.state_dict(), "history": [dict(h) for h in self.history],
                "steps": self.steps, "unmeasured": self.unmeasured, "accumulating": self._accumulating}

    def load_state_dict(self, state: dict) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self.history = [dict(h) for h in state.get("history", [])]
        self.steps, self.unmeasured = int(state.get("steps", 0)), int(state.get("unmeasured", 0))
        self._accumulating = bool(state.get("accumulating", False))

    def close(self) -> None:
        """Remove the monitor's hooks from the model (a DDP comm hook cannot be removed and stays)."""
        if self._open:
            self.abort()
        for h in (self._root, *self._out):
            h.remove()

    def __repr__(self) -> str:
        return (f"GNSMonitor(b_simple={self.b_simple:.4g}, steps={self.steps}, measured={len(self.history)}, "
                f"skipped={self.skipped}, every={self.every})")
