"""Three small real jobs of different scaling behaviour for :class:`elasticlab.cluster.LocalCluster`.

All train on scikit-learn's handwritten digits (1797 8x8 images shipped with scikit-learn, no download).
A cluster *slot* stands for one accelerator. This machine's few shared CPU cores cannot give four slots
four times the compute, so each slot emulates its device: a micro-batch of ``b`` samples costs
``step_s + sample_s * b`` seconds (a sleep, so idle slots do not steal CPU from busy ones) and the
synchronising micro-batch of a ``R``-worker step adds the interconnect's ``sync_s + sync_peer_s * (R - 2)``
(Pollux Eqs. (4)-(5)). The models, gradients, all-reduces and the GNS are real; only the time is emulated.

* :func:`compute_bound` -- an MLP whose per-sample cost dominates: scales almost linearly with slots.
* :func:`comm_bound` -- a tiny linear model on a slow interconnect: more slots make it slower.
* :func:`gns_growing` -- logistic regression on digits with noisy labels: its gradient shrinks fast
  while the per-sample noise stays, so its gradient noise scale grows quickly and large batches pay off.
* :func:`crashing` -- fails after a few steps (to show that its slots return to the pool).

Run directly under torchrun (``python examples/cluster_jobs.py KIND --checkpoint-dir DIR ...``), it trains
one worker's share of that job kind (see :mod:`elasticlab.cluster.torchrun`).
"""
from __future__ import annotations

import argparse
import json
import time

#: Emulated device costs (seconds) per job kind: micro-batch = step_s + sample_s * b; sync (R > 1) =
#: sync_s + sync_peer_s * (R - 2).
DEVICES = {
    "compute_bound": {"step_s": 0.004, "sample_s": 0.0025, "sync_s": 0.004, "sync_peer_s": 0.001},
    "comm_bound": {"step_s": 0.012, "sample_s": 0.0002, "sync_s": 0.045, "sync_peer_s": 0.015},
    "gns_growing": {"step_s": 0.03, "sample_s": 0.0003, "sync_s": 0.004, "sync_peer_s": 0.001},
}


def _digits(label_noise: float = 0.0):
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    if label_noise > 0:  # a fixed fraction of labels replaced by random ones (the same in every worker)
        rng = np.random.default_rng(0)
        flip = rng.random(len(y)) < label_noise
        y = np.where(flip, rng.integers(0, 10, len(y)), y)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def _init(model, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the same initial weights in every worker, whatever its RNG
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1]) ** 0.5)
    return model


class EmulatedLoss:
    """Cross-entropy that also spends the emulated device time of its micro-batch (see module doc)."""

    def __init__(self, step_s: float, sample_s: float, sync_s: float, sync_peer_s: float,
                 crash_after: int | None = None):
        for k, v in (("step_s", step_s), ("sample_s", sample_s), ("sync_s", sync_s),
                     ("sync_peer_s", sync_peer_s)):
            if v < 0:
                raise ValueError(f"{k} must be >= 0, got {v!r}")
        self.step_s, self.sample_s, self.sync_s, self.sync_peer_s = step_s, sample_s, sync_s, sync_peer_s
        self.crash_after = crash_after
        self.calls = 0

    def device_time(self, batch: int, world_size: int, sync: bool) -> float:
        t = self.step_s + self.sample_s * batch
        if sync and world_size > 1:
            t += self.sync_s + self.sync_peer_s * max(world_size - 2, 0)
        return t

    def __call__(self, model, batch):
        import torch.distributed as dist
        import torch.nn.functional as F

        self.calls += 1
        if self.crash_after is not None and self.calls > self.crash_after:
            raise RuntimeError(f"emulated crash after {self.crash_after} micro-batches")
        x, y = batch
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        sync = bool(getattr(model, "require_backward_grad_sync", True))  # False inside DDP.no_sync()
        time.sleep(self.device_time(len(x), world, sync))
        return F.cross_entropy(model(x), y)


def _task(model, data, device: dict, base_batch: int, lr: float, momentum: float, crash_after=None):
    import torch

    from elasticlab.elastic import Task

    return Task(model=model, dataset=data, base_batch=base_batch, loss_fn=EmulatedLoss(**device,
                                                                                       crash_after=crash_after),
                optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum))


def compute_bound(base_batch: int = 32, hidden: int = 64, lr: float = 0.05, **device):
    """An MLP on digits whose emulated cost is mostly per sample (scales with slots)."""
    import torch

    model = _init(torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                      torch.nn.Linear(hidden, 10)))
    return _task(model, _digits(), {**DEVICES["compute_bound"], **device}, base_batch, lr, 0.9)


def comm_bound(base_batch: int = 32, lr: float = 0.05, **device):
    """A linear model on digits on a slow emulated interconnect (communication dominates above 1 slot)."""
    import torch

    model = _init(torch.nn.Linear(64, 10))
    return _task(model, _digits(), {**DEVICES["comm_bound"], **device}, base_batch, lr, 0.9)


def gns_growing(base_batch: int = 32, lr: float = 0.5, label_noise: float = 0.3, **device):
    """Logistic regression on digits with noisy labels: the gradient noise scale grows fast in training."""
    import torch

    model = _init(torch.nn.Linear(64, 10))
    return _task(model, _digits(label_noise), {**DEVICES["gns_growing"], **device}, base_batch, lr, 0.0)


def crashing(base_batch: int = 32, crash_after: int = 5, **device):
    """A job that raises after ``crash_after`` micro-batches (a bug in user code)."""
    import torch

    model = _init(torch.nn.Linear(64, 10))
    return _task(model, _digits(), {**DEVICES["comm_bound"], **device}, base_batch, 0.05, 0.0,
                 crash_after=crash_after)


KINDS = {"compute_bound": compute_bound, "comm_bound": comm_bound, "gns_growing": gns_growing,
         "crashing": crashing}


def main(argv=None) -> int:
    from elasticlab.elastic.worker import torchrun_main

    ap = argparse.ArgumentParser(description="one torchrun worker of a cluster example job")
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--base-batch", type=int, default=32)
    ap.add_argument("--lr-rule", default="constant")
    ap.add_argument("--record-samples", default=None)
    ap.add_argument("--log-steps", action="store_true")
    a = ap.parse_args(argv)
    out = torchrun_main(f"{__file__}:{a.kind}", checkpoint_dir=a.checkpoint_dir,
                        record_samples=a.record_samples,
                        entry_kwargs={"base_batch": a.base_batch}, epochs=a.epochs, max_steps=a.max_steps,
                        checkpoint_every=a.checkpoint_every, lr_rule=a.lr_rule, log_steps=a.log_steps)
    print(json.dumps({"event": "done", **out}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
