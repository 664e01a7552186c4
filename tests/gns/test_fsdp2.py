"""GNSMonitor under FSDP2 (``fully_shard``, 2 gloo processes on 127.0.0.1), eager and compiled: the
per-example form over the global batch, equal to one process's on the same batches (before: every step
unmeasured, silently, since the sharded parameters' hooks never fire); the forms FSDP2 cannot give, and
FSDP1, refused by name."""
import functools
import math

import pytest
import torch
from gloo_util import run_gloo
from torch import nn

from elasticlab.gns import GNSMonitor

fsdp = pytest.importorskip("torch.distributed.fsdp")
WORLD, B_LOCAL, STEPS = 2, 5, 3


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3)).double()


def batches(world=WORLD):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(world * B_LOCAL, 6, generator=g, dtype=torch.float64) for _ in range(STEPS)]


def sharded(mesh_shape=(WORLD,)):
    """The model under FSDP2 on a mesh of ``mesh_shape``: (R, S) is HSDP, R replicas of S shards."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape):])
    net = make()
    for m in (net[0], net[3], net[5]):
        fsdp.fully_shard(m, mesh=mesh)
    return fsdp.fully_shard(net, mesh=mesh)


def train(net, monitor, rows, forward=None, world=WORLD):
    """SGD steps, each batch's rows ``rows`` (a slice) on this process."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x in batches(world):
        opt.zero_grad()
        with monitor.step():
            (forward or net)(x[rows]).pow(2).mean().backward()
        opt.step()
    return {k: [h[k] for h in monitor.history] for k in ("b_simple", "grad_sq", "trace_cov", "batch_size")} \
        | {"method": [h["method"] for h in monitor.history]}


def worker(rank, compiled=False, mesh_shape=(WORLD,)):
    net = sharded(mesh_shape)
    import torch._dynamo
    torch._dynamo.reset()
    forward = torch.compile(net, backend="aot_eager") if compiled else None
    try:
        return train(net, GNSMonitor(net), slice(rank * B_LOCAL, (rank + 1) * B_LOCAL), forward,
                     world=math.prod(mesh_shape))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("compiled,mesh_shape", [(False, (2,)), (True, (2,)), (False, (2, 2))])
def test_fsdp2_matches_one_process(tmp_path, compiled, mesh_shape):
    """(2, 2): HSDP on 4 processes, the gradients replicated along one mesh dimension, sharded along the
    other: their shards' sums all-reduced along the second only."""
    world = math.prod(mesh_shape)
    res = run_gloo(functools.partial(worker, compiled=compiled, mesh_shape=mesh_shape), world, tmp_path)
    net = make()
    ref = train(net, GNSMonitor(net), slice(None), world=world)
    assert ref["method"] == ["per_example"] * STEPS
    for r in res:
        assert r["method"] == ["per_example"] * STEPS and r["batch_size"] == [world * B_LOCAL] * STEPS
        for k in ("b_simple", "grad_sq", "trace_cov"):
            assert r[k] == pytest.approx(ref[k], rel=1e-9), k


def refusals(rank):
    net, out = sharded(), []
    try:
        GNSMonitor(net, method="micro_batch")
    except ValueError as e:
        out.append(str(e))
    monitor = GNSMonitor(net)
    x = batches()[0][rank * B_LOCAL:(rank + 1) * B_LOCAL]
    try:
        with monitor.step():                       # two micro-batches accumulated in one step
            for part in (x[:2], x[2:]):
                net(part).pow(2).mean().backward()
    except RuntimeError as e:
        out.append(str(e))
    try:                                           # FSDP1: before, every step went unmeasured, silently
        GNSMonitor(fsdp.FullyShardedDataParallel(make(), use_orig_params=True, device_id=torch.device("cpu")))
    except ValueError as e:
        out.append(str(e))
    return out


def test_fsdp2_refuses_the_micro_batch_form_and_fsdp1_by_name(tmp_path):
    for msgs in run_gloo(refusals, WORLD, tmp_path):
        assert len(msgs) == 3 and all("FSDP2" in m and "per-example" in m for m in msgs[:2])
        assert "method='micro_batch'" in msgs[0] and "2 backwards" in msgs[1]
        assert "FSDP1" in msgs[2] and "fully_shard" in msgs[2]
