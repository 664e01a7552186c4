"""A small MLP on scikit-learn's handwritten digits (1797 8x8 images, shipped with scikit-learn).

Entry point for :class:`elasticlab.elastic.ElasticJob` (``"examples/digits.py:make_task"``) and for
``elasticlab run examples/digits.py``. Run under torchrun agents, it trains one worker's share; host the
rendezvous store on one address and start one agent per node (see :mod:`elasticlab.cluster.torchrun`):

    python -m elasticlab.cluster.torchrun store --bind 127.0.0.1:29400 &
    python -m elasticlab.cluster.torchrun agent --endpoint 127.0.0.1:29400 --nnodes 1:2 -- \\
        examples/digits.py --checkpoint-dir DIR --epochs 2        # once per node

Across hosts: ``--bind``/``--endpoint`` name the store host's cluster address, each agent adds
``--local-addr`` (its own address), and every host sets the same ``ELASTICLAB_TORCHRUN_TOKEN``. Plain
``torchrun`` against that store works too given ``--local-addr``, ``--rdzv-conf is_host=false`` and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; without them torch's own stores listen on every interface.
"""
from __future__ import annotations

import argparse
import json


def make_task(hidden: int = 64, lr: float = 0.05, base_batch: int = 32, momentum: float = 0.9):
    import torch
    from sklearn.datasets import load_digits

    from elasticlab.elastic import Task

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    with torch.no_grad():  # the same initial weights in every worker, whatever its RNG
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1]) ** 0.5)
    return Task(model=model, dataset=(x, y), base_batch=base_batch,
                optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum))


def main(argv=None) -> int:
    from elasticlab.elastic.worker import torchrun_main

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--record-samples", default=None)
    ap.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (to slow a demo down)")
    ap.add_argument("--log-steps", action="store_true")
    a = ap.parse_args(argv)
    out = torchrun_main(f"{__file__}:make_task", checkpoint_dir=a.checkpoint_dir,
                        record_samples=a.record_samples,
                        entry_kwargs={"base_batch": a.global_batch}, epochs=a.epochs, max_steps=a.max_steps,
                        checkpoint_every=a.checkpoint_every, step_delay_s=a.step_delay, log_steps=a.log_steps)
    print(json.dumps({"event": "done", **out}), flush=True)
    return 0


if __name__ == "__main__":
    from elasticlab.cluster.torchrun import exit_now

    exit_now(main())  # skip the interpreter's slow teardown: torchrun waits for it on every restart
