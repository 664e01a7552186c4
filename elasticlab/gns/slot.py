"""What one covered module recorded in the current step of :class:`~elasticlab.gns.PerSampleGradNorms`: its
rule, the parameters it needs, its calls, the batch size and the per-example norms (or, for the fused layers'
C++ autograd functions, the buffer their backward writes them into)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from elasticlab.gns import host, repeated, sharded
from elasticlab.gns.block import ROWS
from elasticlab.gns.layers.common import positional_names
from elasticlab.gns.registry import covered_params, rule_for, uncovered


class Quiet:
    """While a rule runs a module's forward itself (the generic rule's vjp: :mod:`.layers.generic`), the
    hooks of :class:`~elasticlab.gns.PerSampleGradNorms` on it stay out: that call is not one of the step's.
    A counter, so that it nests."""
    depth = 0

    def __enter__(self):
        Quiet.depth += 1

    def __exit__(self, *exc):
        Quiet.depth -= 1


def recomputing() -> bool:
    """Whether a forward runs inside a backward (activation checkpointing's recomputation; eager only: while
    Dynamo traces, never: a traced recomputation runs no hooks, and the task id would break the graph)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class Slot:
    """What one module recorded in the current step."""

    def __init__(self, owner, name: str, module: nn.Module, rule, need: tuple[str, ...]):
        self.owner, self.name, self.module, self.rule, self.need = owner, name, module, rule, need
        self.host, self.call_need = module, need     # the module whose calls it reads, its names there
        self.arg_names = positional_names(module)     # its forward's arguments a caller may pass by position
        self.calls, self.batch = 0, 0
        self.norms: dict[str, torch.Tensor] = {}
        self.touched: set[str] = set()                    # needed params whose .grad was written, not run
        self.buf: torch.Tensor | None = None              # (2, B) rows a C++ backward writes (weight, bias)
        self._buf_key: tuple | None = None
        self._views: dict[str, torch.Tensor] = {}
        self.index = -1                                   # position among the owner's slots (set by it)
        self.rows = (0, 0)          # its rows of the owner's sink (gns.sink.Sinks), from and to
        self._sink_batch = 0        # the batch its rows hold this step (set by a traced forward), or 0
        self.on_block = False       # this step's norms are the rows of the owner's shared block, unaltered
        self._in_block = False
        self.fused = False          # its forward is its rule's fused form (set by the owner)
        self.tied = False           # one of a tied pair (gns.tied)
        self.fwd_calls = 0          # calls counted in this step's forward (set after it, for recomputation)
        self.shared = False         # seen called more than once in a step: the calls are kept (gns.repeated)
        self.pending: list[tuple[tuple, torch.Tensor]] = []   # (inputs, output gradient) of this step's calls
        self.watched: list[list] = []       # the first step's fused calls' inputs, until its forward ends
        self.spoiled: str | None = None     # why this step's norms cannot be formed (NaN), or None
        self.warned = False
        self.traced = False         # its first call of the step ran under torch.compile
        self.refused = False        # repeated under torch.compile once: an error from then on
        self.mixed = False          # also called in a reentrant checkpoint's recomputation (an error)
        self.unmeasured: dict[str, str] = {}   # needed params used this step in a way no rule takes: why
        self.follow = None          # its layers.broadcast_params.Step: bare parameters, or unbatched calls
        self.seen_batched = False   # an eager call of an unbatched-capable rule had the batch on dim 0
        self.folds: dict = {}       # (batch, input shape) -> its rows' layout, or None (elasticlab.gns.folds)
        self.tp: dict = {}          # a tensor-parallel Linear's layout (gns.sharded.tensor_parallel): hooks
        self.tp_pending = False     # its norms are its shards' still (gns.sharded.reduce_norms)

    def full(self, pname: str) -> str:
        return f"{self.name}.{pname}" if self.name else pname

    def called(self, unbatched: bool = False) -> bool:
        """Counts a call of the module in this step's forward; returns whether it is one whose gradient the
        backward will bring. Not counted: a call with gradients off (no gradient comes of it: an evaluation
        under ``no_grad``, or the first pass of reentrant activation checkpointing, which recomputes it in the
        backward, counted there), and a call during a backward of a module that ran in this step's forward
        (the recomputation of non-reentrant activation checkpointing, whose outputs are not backpropagated:
        the first call's graph is, with the saved tensors recomputed). A second counted call makes the
        module repeated (:func:`elasticlab.gns.repeated.again`). ``unbatched``: a call on an input without
        the batch, followed to its broadcast (:mod:`.layers.broadcast_params`), counted in ``follow`` too."""
        if not torch.is_grad_enabled():
            return False
        if self.fwd_calls and not torch.compiler.is_compiling() and recomputing():
            if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
                repeated.mixed(self)           # not a non-reentrant replay: a reentrant segment's call
            return False
        if self.rule.check is not None:
            self.rule.check(self.module)
        if self.owner._watch:                  # (the first step: tensor-parallel layers but Linear refused)
            sharded.refuse_distributed_weights(self)
        if unbatched:
            self.follow.calls += 1
        self.calls += 1
        if self.calls > 1:
            repeated.again(self)
        else:
            self.traced = torch.compiler.is_compiling()
        return True

    def record(self, norms: dict, batch: int) -> None:
        """Keeps the norms as the backward made them (no launch here: the B² of a mean-reduced loss and the
        loss scale are applied when they are read, one multiply per layer)."""
        self.batch = batch
        self.owner._layer_cache = None
        self.on_block = False
        self.tp_pending = bool(self.tp)
        for pname, v in norms.items():
            if pname in self.need:
                self.norms[pname] = v if not v.requires_grad else v.detach()

    def buffer(self, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This step's (2, B) norms buffer for a fused layer's C++ backward, which writes row 0 (weight) and
        row 1 (bias); recorded now, valid after the backward. Normally rows of the owner's block shared by all
        slots (one reset and one read a step for the whole model); a slot whose batch, dtype or device differs
        from the block's gets its own. Kept across steps of one shape (reset to NaN at each forward, so a read
        before the backward gives NaN; results never alias it)."""
        block = self.owner._block
        key = (batch, dtype, device, block.gen)
        if key != self._buf_key:
            rows = block.rows(self, batch, dtype, device)
            self.buf = rows if rows is not None else torch.full((2, batch), float("nan"), dtype=dtype,
                                                                device=device)
            self._views = {p: r for p, r in zip(ROWS, self.buf.unbind(0)) if p in self.need}
            self._buf_key = (batch, dtype, device, block.gen)
            self._in_block = rows is not None
            self.owner._bufs = None
        self.batch = batch
        self.norms = dict(self._views)
        self.on_block = self._in_block
        self.owner._layer_cache = None
        return self.buf

    def factor(self) -> float:
        """B² for a mean-reduced loss (per-example losses are ℓ_i/B), 1 for a summed one."""
        return float(self.batch) ** 2 if self.owner.loss_reduction == "mean" else 1.0

    def sink(self, x: torch.Tensor) -> torch.Tensor | None:
        """Under ``torch.compile``: this slot's rows of the owner's sink (:class:`elasticlab.gns.sink.Sinks`),
        (len(need), B), a norm per parameter of :attr:`need`, which a fused backward returns as their
        gradient; the sink's hook records them after the compiled backward. None where the sink made before
        the forward (from the batch of the model's input) does not fit x's batch and device, or where none of
        the needed parameters trains (the backward then records the norms itself: correct, with a graph
        break, and nothing where nothing trains)."""
        s, batch = self.owner._sinks.leaf, x.shape[0]
        if s is None or s.shape[1] < batch or s.device != x.device:
            return None
        if not any(self.module._parameters[p].requires_grad for p in self.need):
            return None
        self._sink_batch = batch
        return s[self.rows[0]:self.rows[1], :batch]


def slots_of(owner, model: nn.Module, strict: bool, skipped: list[str]) -> list[Slot]:
    """A :class:`Slot` per module of ``model`` with trainable direct parameters its rule covers (and per
    module whose rule ``calls_children``, when a parameter below it trains). A trainable direct parameter no
    rule covers is a ValueError (``strict``) or listed in ``skipped``, unless it is also a covered
    parameter of another module: an alias, such as the bias of Hugging Face's BERT and ALBERT masked-LM
    heads, which is their decoder Linear's bias (``self.decoder.bias = self.bias``), counted there once."""
    found = []
    for name, mod in model.named_modules():
        direct = [pn for pn, p in mod.named_parameters(recurse=False) if p.requires_grad]
        rule = rule_for(mod)
        names = () if rule is None else covered_params(rule, mod)
        found.append((name, mod, rule, direct, tuple(pn for pn in direct if pn in names)))
    owned = {id(getattr(mod, pn)) for _, mod, _, _, covered in found for pn in covered}
    slots = []
    for name, mod, rule, direct, covered in found:
        if not direct:
            # A rule whose forward calls the children the original forward bypasses (MHA's out_proj) is
            # installed, with nothing of its own to record, when one of their parameters trains.
            if rule is not None and rule.calls_children and any(p.requires_grad for p in mod.parameters()):
                slots.append(Slot(owner, name, mod, rule, ()))
            continue
        missing = [pn for pn in direct if pn not in covered and id(getattr(mod, pn)) not in owned]
        if missing:
            full = [f"{name}.{pn}" if name else pn for pn in missing]
            if strict:
                raise ValueError(uncovered(name, mod, full))
            skipped.extend(full)
        if covered:
            slots.append(slot := Slot(owner, name, mod, rule, covered))
            if rule.on_owner:                          # (a ParametrizationList: <owner>.parametrizations.<t>)
                parts = name.split(".")
                slot.host = model.get_submodule(".".join(parts[:-2]))
                slot.arg_names = positional_names(slot.host)
                slot.call_need = tuple(".".join([*parts[-2:], pn]) for pn in covered)
    return slots


def unmeasured(slots: list[Slot], refuse) -> set[tuple[int, str]]:
    """{(slot id, param)} of needed parameters used in this step in a way their rule could not measure
    (:mod:`.layers.broadcast_params`), each refused by ``refuse`` (an error, or a warning) and its norm
    dropped."""
    out = set()
    for s in slots:
        if not s.unmeasured:                           # (no call per slot in the common case)
            continue
        for pn, why in s.unmeasured.items():
            s.norms.pop(pn, None)
            refuse((s.full(pn),), why, "Use it through a module with a rule, register one with "
                   "elasticlab.gns.register_rule, freeze it, or pass strict=False to leave it out",
                   "the per-example norms and of grad_sq_norm")
            out.add((id(s), pn))
    return out


def finish(owner, vals: list[torch.Tensor], slots: list[Slot]) -> list[torch.Tensor]:
    """Recorded norms of ``slots`` of a :class:`~elasticlab.gns.PerSampleGradNorms` ``owner`` → ‖∇θ ℓ_i‖²:
    times f = B² for a mean-reduced loss (1 for a summed one), divided by the squared loss scale. One
    ``_foreach_mul`` per (f, dtype, device) group instead of a multiply per layer; each element gets the same
    multiply as ``v * f`` (``v * (f / scale²)``) would give it. Every result is a new tensor (f = 1 too):
    recorded norms may be views of buffers reused next step."""
    one_batch({s.name: v.shape[0] for v, s in zip(vals, slots) if v.dim()})
    out: list[torch.Tensor | None] = list(vals)
    groups: dict[tuple, list[int]] = {}
    for i, (v, s) in enumerate(zip(vals, slots)):
        groups.setdefault((s.factor(), v.dtype, v.device), []).append(i)
    for (f, dtype, device), idx in groups.items():
        if owner._scale is not None:
            fac = f / owner._scale.to(device=device, dtype=dtype) ** 2
        elif device.type == "cpu" and dtype in (torch.float32, torch.float64):
            # a 0-dim tensor of the norms' dtype: the multiply a Python float gets, without wrapping
            # and converting the number again for every tensor
            fac = owner._factors.get((f, dtype))
            if fac is None:
                fac = owner._factors[(f, dtype)] = torch.tensor(f, dtype=dtype)
        else:
            fac = f
        for i, r in zip(idx, torch._foreach_mul([vals[i] for i in idx], fac)):
            out[i] = r
    return out


def one_batch(sizes: dict[str, int]) -> None:
    """Raises, naming the odd layers, where the recorded norms of {layer: rows} do not share one batch size
    (the most common one): their rows are not the examples, and a norm per row is not a norm per example."""
    if len(set(sizes.values())) > 1:
        batch = Counter(sizes.values()).most_common(1)[0][0]
        odd = {k: b for k, b in sizes.items() if b != batch}
        raise RuntimeError(
            f"layers disagree on the batch size: most say {batch}, but {odd}. Each layer's input needs the "
            "batch dimension first, or folded into its rows in a layout that can be read: a layer called on "
            "an input without it and broadcast over the batch (a positional embedding on arange(T)) only "
            "sees the batch-summed gradient: expand its input over the batch, e.g. "
            "pos.unsqueeze(0).expand(B, -1); under torch.compile, run one step eagerly first, so that a "
            "folded input's layout is learned")


def layer_totals(slots: list[Slot]) -> list[torch.Tensor]:
    """Per slot, the sum of its recorded norms (its parameters', in order): one ``_foreach_add`` per position
    across the slots instead of an add per layer."""
    per = [list(s.norms.values()) for s in slots]
    totals = [v[0] for v in per]
    k = 1
    while True:
        idx = [i for i, v in enumerate(per) if len(v) > k]
        if not idx:
            return totals
        for i, r in zip(idx, torch._foreach_add([totals[i] for i in idx], [per[i][k] for i in idx])):
            totals[i] = r
        k += 1


def stacked_total(slots: list[Slot], scale: torch.Tensor | None) -> torch.Tensor | None:
    """(B,) Σ of every recorded norm times f/scale², in three launches (stack, sum, multiply), when all are
    (B,) of one dtype and device and every layer has one factor f (:meth:`Slot.factor`); else None."""
    vals: list[torch.Tensor] = []
    f = None
    for s in slots:
        if s.norms:
            fs = s.factor()
            if f is not None and fs != f:
                return None
            f = fs
            vals.extend(s.norms.values())
    if not vals:
        return None
    v0 = vals[0]
    shape, dtype, device = v0.shape, v0.dtype, v0.device
    if len(shape) != 1 or any(v.shape != shape or v.dtype != dtype or v.device != device for v in vals):
        return None
    total = torch.stack(vals).sum(0)
    if scale is not None:
        return total * (f / scale.to(device=device, dtype=dtype) ** 2)
    return total * f if f != 1.0 else total


@dataclass
class GradSquares:
    """Σ g² in float64 of each needed parameter's ``.grad`` per slot (:func:`grad_squares`), taken at one
    moment and left on the devices: shards' sums not yet all-reduced, nothing read to the host."""
    slots: list[Slot]
    sums: list[list[torch.Tensor]]
    groups: list[tuple]                      # sharded.shard_groups of their gradients (flattened in order)
    unseen: list[tuple[int, int, str]]       # (slot, position in its row, parameter): ran, recorded no norm
    scale: torch.Tensor | None               # the loss scale still in the gradients (None: none)

    def read(self) -> tuple[list[list[float]], list[tuple[Slot, str]], float]:
        """(per slot, the sums: FSDP2's shards' sums all-reduced, then one host transfer per device, not one
        per parameter), the (slot, parameter) pairs whose gradient is nonzero though their module ran and
        recorded no norm of them (their sums are given as 0: the norms leave them out too), and the squared
        loss scale to divide out."""
        sums = self.sums
        if self.groups:
            whole = iter(sharded.reduce_sq([t for row in sums for t in row], self.groups))
            sums = [[next(whole) for _ in row] for row in sums]
        flat = iter(host.read([t for row in sums for t in row]))
        out = [[next(flat) for _ in row] for row in sums]
        missed = []
        for i, j, pn in self.unseen:
            if out[i][j] != 0.0:
                missed.append((self.slots[i], pn))
                out[i][j] = 0.0
        return out, missed, 1.0 if self.scale is None else float(self.scale.double()) ** 2


def grad_squares(slots: list[Slot], lost: set, scale: torch.Tensor | None = None) -> GradSquares:
    """:class:`GradSquares` of the parameters with a ``.grad``, those in ``lost`` (slot id, parameter) left
    out; ``scale``: the loss scale in the gradients. Launches only: no host sync, no collective (but the one
    that makes a partial DTensor whole); each norm accumulated in float64 by one ``_foreach_norm`` (no
    float64 copy of a gradient)."""
    where: list[int] = []                    # each gradient's slot
    grads: list[torch.Tensor] = []
    unseen: list[tuple[int, int, str]] = []
    for i, s in enumerate(slots):
        j = 0
        for pname in s.need:
            if lost and (id(s), pname) in lost:
                continue
            p = getattr(s.module, pname)
            if p is not None and p.grad is not None:
                if s.calls and pname not in s.norms:
                    unseen.append((i, j, pname))
                where.append(i)
                grads.append(p.grad)
                j += 1
    sums: list[list[torch.Tensor]] = [[] for _ in slots]
    if grads:
        norms = torch._foreach_norm([sharded.local(g.detach()) for g in grads], 2, dtype=torch.float64)
        for i, sq in zip(where, torch._foreach_mul(norms, norms)):
            sums[i].append(sq)
    return GradSquares(slots, sums, sharded.shard_groups(grads), unseen, scale)


def left_out_why(lost: list[tuple[Slot, str]]) -> str:
    """Why (slot, parameter) pairs the loss depended on have no norm (``PerSampleGradNorms.left_out``): their
    module was followed, or ran but its rule got no gradient, or never ran."""
    names = tuple(s.full(pn) for s, pn in lost)
    mods = sorted({f"{s.name or '(root)'!r} ({type(s.module).__name__})" for s, _ in lost})
    if all(s.calls for s, _ in lost) and all(s.rule.sums_calls or s.follow for s, _ in lost):
        why = (f"the loss depends on {list(names)}, which were followed through the forward of "
               f"{', '.join(mods)} (layers.broadcast_params), but no use of them that reaches the loss "
               "was taken per example (one the following does not see: a tensor op outside "
               "__torch_function__), so their per-example gradients are not known")
    elif all(s.calls for s, _ in lost):     # ran, but the rule's hook got no gradient
        why = (f"the loss depends on {list(names)}, and {', '.join(mods)} ran, but no per-example norm "
               "of them was recorded in the backward: its rule did not form them, or the gradient of its "
               "output never reached the rule's hook (an in-place op on a view of that output sends it "
               "past the hook)")
    else:
        why = (f"the loss depends on {list(names)}, but their module{'s' if len(mods) > 1 else ''} "
               f"{', '.join(mods)} never ran in this step: the parameters were used without calling the "
               "module (e.g. F.linear(x, module.weight), or a parent that reads a child's weight), so no "
               "rule saw their per-example gradients")
    return why


def unrecorded(missed: list[tuple[Slot, str]]) -> str:
    """Why (slot, parameter) pairs with a nonzero gradient but no norm, whose module ran, are a problem."""
    s0 = missed[0][0]
    return (f"no per-example norm of {[s.full(pn) for s, pn in missed]} was recorded, though the gradient "
            f"is nonzero: module {s0.name or '(root)'!r} ({type(s0.module).__name__}) ran, but its rule did "
            "not see these parameters' per-example gradients, so the norms (and the GNS) would leave out "
            "part of the gradient")
