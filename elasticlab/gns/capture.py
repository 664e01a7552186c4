"""``StepGradients``: the squared gradient norms of each backward in one optimizer step, without copies.

For the micro-batch form of McCandlish et al.'s App. A.1 estimator (B_small = micro-batch), each backward's
own gradient h_k is needed, not only the accumulated ``.grad``: a tensor hook on each parameter sees h_k
before autograd adds it to ``.grad`` (no copy of the gradients is kept). The first backward's ‖h_1‖² costs
nothing unless a second one follows: its parameters' ``.grad`` still hold h_1 alone when the second
backward's hooks fire. The first hook of each backward (a new graph task) queues an engine callback that
reads ‖.grad‖ per parameter at the end of that backward, after the callbacks queued during it (DDP's, which
write the averaged gradients), so clipping or ``unscale_`` before the optimizer step does not change it.
:func:`batched_input` finds the tensor that carries a forward's batch, :func:`batch_of` its size.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import Variable

from elasticlab.gns import host, sharded


def batched_input(args: tuple, kwargs: dict | None = None, depth: int = 0) -> torch.Tensor | None:
    """The first tensor with a dimension among a forward's arguments, positional then by keyword (one level
    into lists, tuples and dicts): the one whose dim 0 is the batch."""
    for v in (*args, *(kwargs or {}).values()):
        if isinstance(v, torch.Tensor):
            if v.dim() >= 1:
                return v
        elif depth < 1 and isinstance(v, (list, tuple, dict)):
            t = batched_input(tuple(v.values()) if isinstance(v, dict) else tuple(v), None, depth + 1)
            if t is not None:
                return t
    return None


def batch_of(args: tuple, kwargs: dict | None = None) -> int | None:
    """The batch size of a forward's arguments: dim 0 of :func:`batched_input`."""
    x = batched_input(args, kwargs)
    return None if x is None else int(x.shape[0])


def kept(inputs: tuple):
    """``get()`` giving back a hooked layer's call inputs in its backward: detached, or, where saved-tensor
    hooks are active (non-reentrant activation checkpointing, ``save_on_cpu``), packed by those hooks, so
    that they are dropped and recomputed (or offloaded) like the layer's own saved tensors instead of held.
    The recomputation's call then packs the same tensors (:func:`pack_again`), as checkpointing requires."""
    if inputs and isinstance(inputs[-1], dict):       # a rule's keyword arguments (Rule.kwargs): held
        inputs = (*inputs[:-1], _detached(inputs[-1]))
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        saved = tuple(i.detach() if isinstance(i, torch.Tensor) else i for i in inputs)
        return lambda: saved
    pack, unpack = hooks
    packed = tuple((True, pack(i.detach())) if isinstance(i, torch.Tensor) else (False, i) for i in inputs)
    return lambda: tuple(unpack(v) if t else v for t, v in packed)


def _detached(kw: dict) -> dict:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def pack_again(inputs: tuple) -> None:
    """In a recomputation (non-reentrant checkpointing), the packs :func:`kept` made in the forward."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None:
        for i in inputs:
            if isinstance(i, torch.Tensor):
                hooks[0](i.detach())


def frozen(module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of ``module``'s parameters that do not train now."""
    return [(n, p) for n, p in module.named_parameters() if not p.requires_grad]


def now_training(params: list[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    """The names of ``params`` (from :func:`frozen`) that train now: unfrozen since (gradual unfreezing),
    which what was set up with the trainable ones leaves out."""
    return tuple(n for n, p in params if p.requires_grad)


def _norm(t: torch.Tensor) -> torch.Tensor:
    """‖t‖ in float32, or in t's own dtype where that is wider (float64)."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.promote_types(t.dtype, torch.float32))


class StepGradients:
    """Per-backward gradient norms of ``params`` between :meth:`start` and :meth:`stop`.

    ``after_backward``: called (no arguments) at the end of each backward, after ``.grad`` was read.
    ``read_first = False`` leaves ``.grad`` unread after the first backward (a caller that reads it then);
    ``read_grads = False`` after every backward (the backwards only counted: FSDP2's per-example form).
    """

    def __init__(self, params: list[torch.Tensor], after_backward: Callable[[], None] | None = None):
        self.params = list(params)
        self.after_backward = after_backward
        self.read_first = True                # False: skip reading .grad after a step's first backward
        self.read_grads = True                # False: after every backward
        self._hooks: list = []
        self.reset()

    def reset(self) -> None:
        self.backwards = 0
        self._task = None
        self._micro: list[list[tuple[int, torch.Tensor]]] = []    # per backward: (param index, ‖h_k‖)
        self._last: list[tuple[int, torch.Tensor]] = []           # (param index, ‖.grad‖) after the last

    def start(self) -> None:
        self.reset()
        for i, p in enumerate(self.params):  # (one at a time: those made before an error are removed by stop)
            self._hooks.append(p.register_hook(self._hook(i)))

    def stop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, i: int):
        p = self.params[i]

        def hook(g):
            self._seen()
            if self.backwards >= 2:           # ‖·‖ in float32 at least, no copy; squared in float64 when read
                if self.backwards == 2 and p.grad is not None:     # .grad still holds h_1 alone
                    self._micro[0].append((i, _norm(p.grad)))
                self._micro[-1].append((i, _norm(g)))
            return None
        return hook

    def _seen(self, g=None) -> None:
        tid = torch._C._current_graph_task_id()
        if tid != self._task:                 # the first gradient of a new backward
            self._task = tid
            self.backwards += 1
            self._micro.append([])
            Variable._execution_engine.queue_callback(self._queue_again)

    def watch(self, output) -> None:
        """Count the backwards through a forward's ``output`` (its tensors that need a gradient, in tuples,
        lists and dicts), for parameters whose own hooks never fire (FSDP2's: :mod:`elasticlab.gns.sharded`);
        the per-backward norms ``micro_sq`` come from the parameters' hooks only."""
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self._hooks.append(t.register_hook(self._seen))

    def _queue_again(self) -> None:
        Variable._execution_engine.queue_callback(self._read)

    def _read(self) -> None:
        if not self.read_grads or (self.backwards == 1 and not self.read_first):   # (the caller has them)
            self._last = []
            if self.after_backward is not None:
                self.after_backward()
            return
        have = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = [self.params[i].grad.detach() for i in have]
        norms = [_norm(sharded.local(g)) for g in grads] if any(g.dtype == torch.float64 for g in grads) \
            else torch._foreach_norm([sharded.local(g) for g in grads], 2, dtype=torch.float32)
        groups = sharded.shard_groups(grads)  # FSDP2: ‖shard‖² summed over the shards
        if groups:
            norms = [v.sqrt() for v in sharded.reduce_sq([v.double().square() for v in norms], groups)]
        self._last = list(zip(have, norms))
        if self.after_backward is not None:
            self.after_backward()

    def _vector(self, pairs, square: bool) -> torch.Tensor:
        """(P,) float64 on the CPU from (parameter index, 0-dim tensor) pairs, one host read per device."""
        out = torch.zeros(len(self.params), dtype=torch.float64)
        if pairs:
            vals = torch.tensor(host.read([v for _, v in pairs]), dtype=torch.float64)
            out.index_add_(0, torch.tensor([i for i, _ in pairs]), vals.pow(2) if square else vals)
        return out

    def micro_sq(self) -> torch.Tensor:
        """(backwards, P): ‖h_k‖² per backward and parameter (only when there were >= 2 backwards)."""
        return torch.stack([self._vector(row, True) for row in self._micro])

    def grad_sq(self) -> torch.Tensor:
        """(P,): ‖.grad‖² per parameter at the end of the last backward."""
        return self._vector(self._last, True)
