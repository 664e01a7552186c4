"""Per-example gradient norms and the GNS monitor under tensor parallelism (``parallelize_module``'s
ColwiseParallel / RowwiseParallel on nn.Linear, 2 gloo processes on 127.0.0.1), against torch.func and one
process in float64. Before, every tensor-parallel layer was refused ("not supported"). Each process's norms
are those of its shard of the weight; the whole weight's are their sum over the mesh dimension it is
sharded along, a replicated bias counted once. Also: a layer's output redistributed by its parallel style
(a sequence-sharded RowwiseParallel output) is read before the redistribution; the monitor asks for the
data-parallel group; FSDP2 around tensor parallelism (2-D) too; nn.Embedding split by rows (the vocabulary) or
columns; other tensor-parallel layers are refused by name."""
import functools

import pytest
import torch
from gloo_util import run_gloo
from torch import nn

from elasticlab.gns import GNSMonitor, PerSampleGradNorms
from elasticlab.gns.reference import func_param_sq_norms

pytest.importorskip("torch.distributed.tensor.parallel")
WORLD, B, STEPS = 2, 5, 3


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def batch(seq: bool, seed: int = 3, n: int = B):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, 6, generator=g, dtype=torch.float64) if seq else \
        torch.randn(n, 6, generator=g, dtype=torch.float64)


def parallel(mesh, seq_out: bool = False):
    """The Megatron pair on layers 3 (column-wise) and 5 (row-wise); ``seq_out``: layer 5's output
    reduce-scattered along the sequence (each process its half of the positions)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    row = RowwiseParallel(output_layouts=Shard(1)) if seq_out else RowwiseParallel()
    return parallelize_module(make(), mesh, {"3": ColwiseParallel(), "5": row})


def norms_worker(rank, fused, seq, seq_out):
    from torch.distributed.device_mesh import init_device_mesh
    tp = parallel(init_device_mesh("cpu", (WORLD,)), seq_out)
    with PerSampleGradNorms(tp, loss_reduction="sum", fused=fused) as psn:
        out = tp(batch(seq))
        assert out.shape[1] == (2 if seq_out else 4) or not seq
        out.pow(2).sum().backward()          # with seq_out: each process's positions; their sum is the loss
        return {"layers": psn.layer_sq_norms(), "params": psn.param_sq_norms(), "total": psn.sq_norms(),
                "grad_sq": psn.grad_sq_norm()}


@pytest.mark.parametrize("fused,seq,seq_out", [(True, False, False), (True, True, False),
                                               (False, True, False), (True, True, True)])
def test_tensor_parallel_norms_match_torch_func(tmp_path, fused, seq, seq_out):
    res = run_gloo(functools.partial(norms_worker, fused=fused, seq=seq, seq_out=seq_out), WORLD, tmp_path)
    net, x = make(), batch(seq)
    ref = func_param_sq_norms(net, lambda o, y: o.pow(2).sum(), x, torch.zeros(B))
    net(x).pow(2).sum().backward()
    grad_sq = sum(float(p.grad.pow(2).sum()) for p in net.parameters()) / B ** 2
    for r in res:
        assert set(r["params"]) == set(ref)
        for name, v in ref.items():                   # the row-wise bias (replicated) counted once
            assert torch.allclose(r["params"][name], v, rtol=1e-9), (name, r["params"][name] / v)
        assert torch.allclose(r["total"], sum(ref.values()), rtol=1e-9)
        assert sorted(r["layers"]) == ["0", "2", "3", "5"]
        assert r["grad_sq"] == pytest.approx(grad_sq, rel=1e-9)


class Twice(nn.Module):
    """A tensor-parallel Linear called twice in a forward (its calls' norms are formed when read)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.lin, self.out = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.lin(torch.tanh(self.lin(self.a(x)))))


def twice_worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    net = parallelize_module(Twice().double(), init_device_mesh("cpu", (WORLD,)),
                             {"lin": ColwiseParallel(output_layouts=Replicate())})
    with PerSampleGradNorms(net, loss_reduction="sum") as psn:
        net(batch(True)).pow(2).sum().backward()
        return psn.param_sq_norms()


def test_a_tensor_parallel_layer_called_twice(tmp_path):
    """Its shards' norms summed after its calls are (before: summed before, the calls' sum then a shard's:
    'lin.weight' 0.54 of torch.func's)."""
    ref = func_param_sq_norms(Twice().double(), lambda o, y: o.pow(2).sum(), batch(True), torch.zeros(B))
    for r in run_gloo(twice_worker, WORLD, tmp_path):
        for name, v in ref.items():
            assert torch.allclose(r[name], v, rtol=1e-9), (name, (r[name] / v).tolist())


def train(net, monitor, forward=None, n=B):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for k in range(STEPS):
        opt.zero_grad()
        with monitor.step():
            (forward or net)(batch(True, seed=k, n=n)).pow(2).mean().backward()
        opt.step()
    return {k: [h[k] for h in monitor.history] for k in ("b_simple", "method", "batch_size")} | {
        "layers": monitor.layer_b_simple()}


def monitor_worker(rank, compiled, given):
    """``given``: the data-parallel group passed, else found by the monitor (before: refused, "pass
    process_group=")."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    tp = parallel(mesh["tp"])
    import torch._dynamo
    torch._dynamo.reset()
    forward = torch.compile(tp, backend="aot_eager") if compiled else None   # (a graph break at each layer)
    try:
        monitor = GNSMonitor(tp, process_group=mesh["dp"].get_group() if given else None)
        return train(tp, monitor, forward) | {"group": torch.distributed.get_world_size(monitor.group)}
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("compiled,given", [(False, True), (True, True), (False, False)])
def test_monitor_under_tensor_parallelism_matches_one_process(tmp_path, compiled, given):
    net = make()
    ref = train(net, GNSMonitor(net))
    for r in run_gloo(functools.partial(monitor_worker, compiled=compiled, given=given), WORLD, tmp_path):
        assert r["group"] == 1                     # (the processes see the same examples)
        assert r["method"] == ["per_example"] * STEPS and r["batch_size"] == [B] * STEPS
        assert r["b_simple"] == pytest.approx(ref["b_simple"], rel=1e-9)
        assert r["layers"] == pytest.approx(ref["layers"], rel=1e-9) and len(r["layers"]) == 4


def fsdp_tp_worker(rank, given=True):
    """torchtitan's 2-D layout: tensor parallelism inside FSDP2 on a (dp=2, tp=2) mesh, 4 processes; the
    processes of one tp group read the same examples, the dp groups different ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, WORLD), mesh_dim_names=("dp", "tp"))
    net = parallel(mesh["tp"])
    for m in (net[3], net[5], net):
        fully_shard(m, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    rows = slice(dp * B, (dp + 1) * B)
    monitor = GNSMonitor(net, process_group=mesh["dp"].get_group() if given else None)
    assert torch.distributed.get_process_group_ranks(monitor.group) == mesh["dp"].mesh.tolist()
    return train(net, monitor, lambda x: net(x[rows]), 2 * B)


@pytest.mark.parametrize("given", [True, False])
def test_monitor_under_fsdp2_with_tensor_parallelism_matches_one_process(tmp_path, given):
    """Not ``given``: the monitor finds the dp group itself (before: refused)."""
    net = make()
    ref = train(net, GNSMonitor(net), None, 2 * B)
    for r in run_gloo(functools.partial(fsdp_tp_worker, given=given), 2 * WORLD, tmp_path):
        assert r["method"] == ["per_example"] * STEPS and r["batch_size"] == [2 * B] * STEPS
        assert r["b_simple"] == pytest.approx(ref["b_simple"], rel=1e-9)
        assert r["layers"] == pytest.approx(ref["layers"], rel=1e-9) and len(r["layers"]) == 4


class Embedded(nn.Module):
    """A vocabulary of 11 (split 6 + 5 row-wise), a LayerNorm, a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.ln, self.out = nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 2)

    def forward(self, i):
        return self.out(self.ln(self.emb(i)))


IDS = torch.tensor([[1, 2, 2, 9], [10, 3, 4, 10], [0, 5, 6, 7], [8, 8, 8, 8], [5, 6, 5, 6]])


def embedding_worker(rank, style):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"rowwise": RowwiseParallel(input_layouts=Replicate()),     # (torchtitan's: the positions split)
            "rowwise-seq": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "colwise": ColwiseParallel(output_layouts=Replicate())}[style]
    net = parallelize_module(Embedded().double(), init_device_mesh("cpu", (WORLD,)), {"emb": plan})
    with PerSampleGradNorms(net, loss_reduction="sum") as psn:
        net(IDS).pow(2).sum().backward()
        return psn.param_sq_norms(), tuple(net.emb.weight.to_local().shape)


@pytest.mark.parametrize("style", ["rowwise", "rowwise-seq", "colwise"])
def test_a_tensor_parallel_embedding_matches_torch_func(tmp_path, style):
    """Before: refused by name. Row-wise, each process holds a range of the vocabulary (rows 0-5 and 6-10)
    and counts the positions whose index falls there (also with the output split along the sequence, as
    torchtitan's token embedding: each process's loss is over its positions, their sum the loss); column-wise,
    a slice of every row."""
    ref = func_param_sq_norms(Embedded().double(), lambda o, y: o.pow(2).sum(), IDS, torch.zeros(len(IDS)))
    res = run_gloo(functools.partial(embedding_worker, style=style), WORLD, tmp_path)
    shapes = [shape for _, shape in res]
    assert shapes == ([(11, 4), (11, 4)] if style == "colwise" else [(6, 8), (5, 8)])
    for r, _ in res:
        assert set(r) == set(ref)
        for name, v in ref.items():   # (sequence-split output: the layers after it see half the positions)
            if style != "rowwise-seq" or name == "emb.weight":
                assert torch.allclose(r[name], v, rtol=1e-9), (name, (r[name] / v).tolist())


def fsdp_embedding_worker(rank):
    """The row-wise embedding inside FSDP2 on a (dp=2, tp=2) mesh: each dp group its examples."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, WORLD), mesh_dim_names=("dp", "tp"))
    plan = {"emb": RowwiseParallel(input_layouts=Replicate())}
    net = parallelize_module(Embedded().double(), mesh["tp"], plan)
    for m in (net.emb, net):
        fully_shard(m, mesh=mesh["dp"])
    rows = [0, 1, 2] if mesh["dp"].get_local_rank() == 0 else [3, 4]
    with PerSampleGradNorms(net, loss_reduction="sum") as psn:
        net(IDS[rows]).pow(2).sum().backward()
        return rows, psn.param_sq_norms()


def test_a_tensor_parallel_embedding_inside_fsdp2_matches_torch_func(tmp_path):
    ref = func_param_sq_norms(Embedded().double(), lambda o, y: o.pow(2).sum(), IDS, torch.zeros(len(IDS)))
    for rows, r in run_gloo(fsdp_embedding_worker, 2 * WORLD, tmp_path):
        assert set(r) == set(ref)
        for name, v in ref.items():
            assert torch.allclose(r[name], v[rows], rtol=1e-9), (name, (r[name] / v[rows]).tolist())


class TiedHead(nn.Module):
    """A vocabulary of 11, a LayerNorm, and an output layer whose weight is the embedding's table."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.ln, self.out = nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, i):
        return self.out(self.ln(self.emb(i)))


def tied_worker(rank, split):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"vocab": {"emb": RowwiseParallel(input_layouts=Replicate()),         # Megatron's: both Shard(0)
                      "out": ColwiseParallel(output_layouts=Replicate())},
            "width": {"emb": ColwiseParallel(output_layouts=Replicate()),        # both Shard(1)
                      "out": RowwiseParallel(input_layouts=Replicate())}}[split]
    net = parallelize_module(TiedHead().double(), init_device_mesh("cpu", (WORLD,)), plan)
    net.out.weight = net.emb.weight                  # (parallelize_module made each a parameter of its own)
    with PerSampleGradNorms(net, loss_reduction="sum") as psn:
        net(IDS).pow(2).sum().backward()
        return psn.param_sq_norms(), tuple(net.emb.weight.to_local().shape)


@pytest.mark.parametrize("split", ["vocab", "width"])
def test_a_tied_table_split_by_tensor_parallelism_matches_torch_func(tmp_path, split):
    """Before: refused by name (and about 1.4x the truth before the refusal). Each process forms the tied
    table's three terms (embedding, output layer, cross) on its block of the table: its rows 0-5 or 6-10, or
    its half of every row."""
    ref = func_param_sq_norms(TiedHead().double(), lambda o, y: o.pow(2).sum(), IDS, torch.zeros(len(IDS)))
    assert set(ref) == {"emb.weight", "ln.weight", "ln.bias"}          # (torch.func: the tied table once)
    res = run_gloo(functools.partial(tied_worker, split=split), WORLD, tmp_path)
    assert [shape for _, shape in res] == ([(6, 8), (5, 8)] if split == "vocab" else [(11, 4), (11, 4)])
    for r, _ in res:
        assert set(r) == set(ref)
        for name, v in ref.items():
            assert torch.allclose(r[name], v, rtol=1e-9), (name, (r[name] / v).tolist())


def refused_worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    mesh = init_device_mesh("cpu", (WORLD,))
    net = parallelize_module(Embedded().double(), mesh, {"ln": SequenceParallel()})
    try:
        with PerSampleGradNorms(net):
            net(IDS).sum().backward()
    except ValueError as e:
        return str(e)
    return None


def test_other_tensor_parallel_layers_are_refused_by_name(tmp_path):
    for msg in run_gloo(refused_worker, WORLD, tmp_path):
        assert msg is not None and "module 'ln' (LayerNorm)" in msg and "tensor parallelism" in msg
        assert "nn.Linear and nn.Embedding" in msg


class Split(nn.Module):
    """A model as transformers leaves it after its own tensor parallelism (``tp_size``, ``tp_plan``), but
    not split: what the check reads, and no mesh."""

    def __init__(self, styles: dict):
        super().__init__()
        self.proj, self.norm, self.own = nn.Linear(4, 4), nn.RMSNorm(4), nn.Module()
        self.own.gain = nn.Parameter(torch.ones(4))
        self.own.forward = lambda x: x * self.own.gain
        self.tp_size, self.tp_plan = 2, styles

    def forward(self, x):
        return self.own(self.norm(self.proj(x)))


@pytest.mark.parametrize("styles,name,says", [
    ({"proj": "packed_colwise"}, "'proj' (Linear)", "checked for ['colwise'"),
    ({"norm": "replicated_with_grad_allreduce"}, "'norm' (RMSNorm)", "on the generic rule only"),
    ({"own": "replicated_with_grad_allreduce"}, "'own' (Module)", "on the generic rule only"),   # no mesh
    ({"*.gain": "sequence_parallel"}, None, None),                      # (a pattern that names no module)
])
def test_transformers_styles_not_checked_are_refused_by_name(styles, name, says):
    model = Split(styles)
    if name is None:
        PerSampleGradNorms(model)
        return
    with pytest.raises(ValueError, match="transformers' tensor-parallel style") as e:
        PerSampleGradNorms(model)
    assert name in str(e.value) and says in str(e.value)
