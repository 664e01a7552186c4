"""Gradient noise scale under DistributedDataParallel: norms on the local batch, replicas combined.

Two ways to combine R replicas (McCandlish et al. App. A.1):
- per-example: all-reduce Σ_i ‖g_i‖² and the example count, with ‖ḡ‖² of the all-reduced (global) gradient,
  gives the per-example estimator over the global batch (:func:`elasticlab.gns.forms.per_example`);
- two-batch: each replica's local gradient norm (B_small = local batch), taken by a DDP communication hook
  before the all-reduce, against the all-reduced one (B_big = global batch) (:class:`ReplicaGradNorms`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from elasticlab.gns import forms, host
from elasticlab.gns.estimator import GNSEstimator

#: GNSMonitor's warning where a step's backwards were all-reduced more than once (accumulation, no no_sync)
SYNCED = ("GNSMonitor: DDP all-reduced the gradient in {} of this step's {} backwards, so each replica's "
          "own accumulated gradient, which the replica form needs, is gone: such steps are not measured. Run "
          "every micro-batch but the last under `with model.no_sync():` (Lightning and the HF Trainer do)")


def _grad_sq(params) -> float:
    """Σ ‖.grad‖² in float64: one ``_foreach_norm`` and one host read per device (no float64 copies)."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return math.fsum(host.read(torch._foreach_mul(norms, norms)))


class ReplicaGradNorms:
    """A DDP communication hook that records this replica's local gradient ‖g_local‖² before averaging.

    ``ddp.register_comm_hook`` is called on construction (a DDP model takes one hook). After each synchronised
    backward, :meth:`update` folds the two-batch estimate (B_small = local batch, B_big = global batch).
    """

    def __init__(self, ddp_model: torch.nn.parallel.DistributedDataParallel, process_group=None):
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("ReplicaGradNorms needs a DistributedDataParallel model, got "
                             f"{type(ddp_model).__name__}")
        self.model, self.group = ddp_model, process_group
        named = [(n, p) for n, p in ddp_model.module.named_parameters() if p.requires_grad]
        self._index = {id(p): i for i, (_, p) in enumerate(named)}
        self.layer_of = forms.layer_of(named)                       # each parameter's module
        self._per = torch.zeros(len(named), dtype=torch.float64)    # each local gradient's Σ g² (its device)
        self.syncs = 0                                              # synchronised backwards since reset
        ddp_model.register_comm_hook(self, ReplicaGradNorms._hook)

    @staticmethod
    def _hook(state: ReplicaGradNorms, bucket):
        buf = bucket.buffer()
        state.syncs += bucket.index() == 0          # (every bucket is reduced in each synchronised backward)
        state._record(bucket)
        world = dist.get_world_size(state.group)
        fut = dist.all_reduce(buf.div_(world), group=state.group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def _record(self, bucket) -> None:
        """Each parameter's ‖g_local‖² in ``bucket`` (before the averaging), added on the device: no host
        synchronisation in the backward."""
        grads = [g.detach() for g in bucket.gradients()]
        if not grads:
            return
        dev = grads[0].device
        if self._per.device != dev:
            self._per = self._per.to(dev)
        norms = torch._foreach_norm(grads, 2)                     # (a DDP bucket holds one dtype)
        idx = torch.tensor([self._index[id(p)] for p in bucket.parameters()], device=dev)
        self._per.index_add_(0, idx, torch.stack(norms).double().square())

    @property
    def local_sq_norm(self) -> float:
        """‖g_local‖² of this replica's gradient in the last synchronised backward."""
        return float(self._per.sum())

    def reset(self) -> None:
        """Forget the recorded ‖g_local‖² (callers that fold it themselves do this after each step)."""
        self._per.zero_()
        self.syncs = 0

    def fold(self, estimator: GNSEstimator, div: float, batch: int, big: float, layers: dict | None = None):
        """GNSMonitor's replica form, unequal batches by their harmonic mean H (Eq. A.1): this replica's
        ‖g_local‖²/``div`` against ``big``, ‖ḡ‖² of the averaged gradient (divided alike); ``layers``:
        {module: its ‖ḡ‖²}, folded per layer too. One all-reduce of [Σ_r ‖ḡ_r‖², Σ 1/b_r, Σ b_r, R, and
        per layer Σ_r ‖ḡ_r‖²]. Returns (folded, Σ b_r), or None where this replica had no gradient; resets."""
        per = self._per.tolist()                                   # (read before the reset zeroes it)
        self.reset()
        names = list(layers or {})
        by_layer = dict.fromkeys(names, 0.0)
        for name, v in zip(self.layer_of, per):
            if name in by_layer:
                by_layer[name] += v
        local = math.fsum(per)
        t = torch.tensor([local / div, 1.0 / batch, float(batch), 1.0, *(by_layer[n] / div for n in names)],
                         dtype=torch.float64, device=forms.comm_device(self.group))
        dist.all_reduce(t, group=self.group)
        small, inv, total, r, *per_layer = t.tolist()
        h = r / inv
        if local == 0.0 or not math.isfinite(h):
            return None
        folded = estimator.update_two_batch(small / r, big, h, r * h)
        for n, v in zip(names, per_layer):
            estimator.update_two_batch(v / r, layers[n], h, r * h, layer=n)
        return folded, int(round(total))

    def update(self, estimator: GNSEstimator, local_batch: int) -> bool:
        """Fold the two-batch estimate of the last backward into ``estimator`` and reset."""
        world = dist.get_world_size(self.group)
        if world < 2:
            raise ValueError(f"the replica two-batch estimator needs >= 2 replicas, got world size {world}")
        t = torch.tensor([self.local_sq_norm, float(local_batch)], dtype=torch.float64)
        t = t.to(forms.comm_device(self.group))
        dist.all_reduce(t, group=self.group)
        t = t.cpu()
        if abs(float(t[1]) - world * local_batch) > 0.5:
            raise ValueError(f"replicas have different local batch sizes (sum {float(t[1]):.0f} != "
                             f"{world} x {local_batch}); the two-batch estimator needs equal ones")
        small = float(t[0]) / world
        big = _grad_sq(self.model.parameters())
        self.reset()
        return estimator.update_two_batch(small, big, local_batch, world * local_batch)
