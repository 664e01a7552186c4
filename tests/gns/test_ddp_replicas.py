"""Under DDP (2 gloo processes on 127.0.0.1): local per-example norms, replicas combined, vs one process; an
MLP, and a ViT-like model whose class token and position embedding are bare parameters of the root
(gns.layers.broadcast_params, which DDP calls through its forward)."""
import functools

import pytest
import torch
import torch.nn.functional as F
from gloo_util import run_gloo
from torch import nn

from elasticlab.gns import GNSEstimator, PerSampleGradNorms
from elasticlab.gns.ddp import ReplicaGradNorms
from elasticlab.gns.forms import per_example

B_LOCAL, WORLD = 6, 2


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch, self.norm, self.head = nn.Linear(5, 8), nn.LayerNorm(8), nn.Linear(8, 3)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, 8))

    def forward(self, x):
        h = self.patch(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        return self.head(self.norm(torch.tanh(h)))


def make(kind="mlp"):
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)) if kind == "mlp"
             else Tokens()).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * B_LOCAL, 4, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (WORLD * B_LOCAL,), generator=g)
    return model, x, y


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).mean(1), y)


def worker(rank, kind="mlp"):
    model, x, y = make(kind)
    sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    ddp = nn.parallel.DistributedDataParallel(model)
    replicas = ReplicaGradNorms(ddp)
    per_ex, two = GNSEstimator(beta=0.0), GNSEstimator(beta=0.0)
    with PerSampleGradNorms(model) as n:
        loss_fn(ddp, x[sl], y[sl]).backward()
    grad_sq = sum(float(p.grad.pow(2).sum()) for p in model.parameters())
    per_example(per_ex, [n.sq_norms()], grad_sq, world=torch.distributed.get_world_size())
    local_sq = replicas.local_sq_norm
    replicas.update(two, B_LOCAL)
    return {"local_norms": n.sq_norms(), "per_ex": per_ex.state_dict(), "two": two.state_dict(),
            "local_sq": local_sq, "grads": [p.grad.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("kind", ["mlp", "vit"])
def test_ddp_two_gloo_processes(tmp_path, kind):
    res = run_gloo(functools.partial(worker, kind=kind), WORLD, tmp_path)
    model, x, y = make(kind)
    # single-process reference on the global batch
    with PerSampleGradNorms(model) as n:
        loss_fn(model, x, y).backward()
    global_norms = n.sq_norms()
    grads = [p.grad for p in model.parameters()]
    for r in range(WORLD):
        torch.testing.assert_close(res[r]["local_norms"], global_norms[r * B_LOCAL:(r + 1) * B_LOCAL])
        for g1, g2 in zip(res[r]["grads"], grads):
            torch.testing.assert_close(g1, g2)
    ref = GNSEstimator(beta=0.0)
    ref.update(global_norms, sum(float(g.pow(2).sum()) for g in grads))
    for r in range(WORLD):
        e = GNSEstimator()
        e.load_state_dict(res[r]["per_ex"])
        assert abs(e.grad_sq - ref.grad_sq) < 1e-9 * abs(ref.grad_sq)      # (b_simple may be inf: |G|² < 0)
        assert abs(e.trace_cov - ref.trace_cov) < 1e-9 * abs(ref.trace_cov)
    # two-batch: local gradients (b=6) against the averaged one (b=12)
    local = []
    for r in range(WORLD):
        model.zero_grad()
        sl = slice(r * B_LOCAL, (r + 1) * B_LOCAL)
        loss_fn(model, x[sl], y[sl]).backward()
        local.append(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        assert abs(res[r]["local_sq"] - local[-1]) < 1e-9 * local[-1]
    want = GNSEstimator(beta=0.0)
    big = sum(float(g.pow(2).sum()) for g in grads)
    want.update_two_batch(sum(local) / WORLD, big, B_LOCAL, WORLD * B_LOCAL)
    for r in range(WORLD):
        e = GNSEstimator()
        e.load_state_dict(res[r]["two"])
        assert abs(e.grad_sq - want.grad_sq) < 1e-9 * abs(want.grad_sq)
        assert abs(e.trace_cov - want.trace_cov) < 1e-9 * abs(want.trace_cov)
