"""The Lightning callback against GNSEstimator fed the same batches by hand: per-example,
accumulate_grad_batches, bf16-mixed, the DDP strategy on 2 gloo processes (replica form) and the
ModelParallelStrategy with FSDP2 (per-example form)."""
import copy
import datetime
import gc
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from elasticlab.gns import GNSEstimator, PerSampleGradNorms  # noqa: E402
from elasticlab.integrations import BatchSizeController  # noqa: E402
from elasticlab.integrations.lightning import GradientNoiseScale  # noqa: E402

N, B, LR = 48, 8, 0.1


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 6, generator=g)
    return TensorDataset(x, (x @ torch.randn(6, 3, generator=g)).argmax(1))


class Module(pl.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.clone(), y.clone()))
        return F.cross_entropy(self.net(x), y)            # the submodule: the root's forward never runs

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class Memory(pl.loggers.Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))


def fit(callback, steps, **kw):
    module, logger = Module(make_net()), Memory()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1,
                         callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **kw)
    trainer.fit(module, DataLoader(dataset(), batch_size=B))
    return module, logger


def logged(logger, key):
    return [r[key] for r in logger.rows if key in r]


def per_example_reference(steps, autocast=False, net=None):
    net, ref, out = net or make_net(), GNSEstimator(beta=0.99), []
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    data = DataLoader(dataset(), batch_size=B)
    with PerSampleGradNorms(net) as norms:
        for _, (x, y) in zip(range(steps), data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                F.cross_entropy(net(x), y).backward()
            ref.update_from(norms)
            out.append(ref.b_simple)
            opt.step()
    return out


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_per_example_history_and_logged_metrics(precision):
    cb = GradientNoiseScale(log_layers=True)
    _, logger = fit(cb, 4, precision=precision)
    expected = per_example_reference(4, autocast=precision == "bf16-mixed")
    got = [h["b_simple"] for h in cb.history]
    assert [h["method"] for h in cb.history] == ["per_example"] * 4
    assert [h["step"] for h in cb.history] == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(logged(logger, "gns/b_simple")), torch.tensor(expected),
                               rtol=1e-5, atol=0)
    assert len(logged(logger, "gns/trace_cov")) == 4 and len(logged(logger, "gns/layer/net.2")) == 4


class Positions(nn.Module):
    """The 6 features as 3 tokens of 2, plus a positional embedding on arange(3): batch-less, broadcast."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.pos, self.head = nn.Linear(2, 8), nn.Embedding(3, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x.reshape(x.shape[0], 3, 2)) + self.pos(torch.arange(3))
        return self.head(torch.tanh(h)).mean(1)


@pytest.mark.parametrize("compiled", [False, True])
def test_batchless_positions_in_a_submodule_eager_and_compiled(compiled):
    """``training_step`` calls a submodule (the root's forward never runs) holding a batch-less positional
    embedding, eagerly or ``torch.compile``'d (aot_eager): the callback's batch size tells the norms what
    the embedding's output is broadcast to, and under compile the first step runs eagerly (eager_first);
    every step per example, with the estimates of a plain loop (before: "layers disagree on the batch size"
    at the first step, eager or compiled)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    cb = GradientNoiseScale()
    module = Module(torch.compile(Positions(), backend="aot_eager") if compiled else Positions())
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, callbacks=[cb],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(module, DataLoader(dataset(), batch_size=B))
        # compiled: the first step eager, the later ones traced (before the fix of its release, a root
        # whose forward never runs held the stance at every step, so nothing was ever compiled)
        assert (counters["stats"]["calls_captured"] > 0) == compiled
    finally:
        torch._dynamo.reset()
    expected = per_example_reference(3, net=Positions())          # (the same unshuffled batches)
    assert [h["method"] for h in cb.history] == ["per_example"] * 3
    assert [h["b_simple"] for h in cb.history] == pytest.approx(expected, rel=1e-5)


class Root(pl.LightningModule):
    """Positions as the root's own forward, for Lightning's ``torch.compile(module)`` path."""

    def __init__(self):
        super().__init__()
        self.net = Positions()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def test_a_compiled_lightning_module():
    """``trainer.fit(torch.compile(module))``: Lightning unwraps the module and compiles its ``forward`` and
    ``training_step``, so that the callback's hooks on the root are traced with them. Every step per
    example, with a plain loop's estimates; the later steps traced, and broken only where the norms begin a
    step eagerly (before: also at the monitor's hook, which asked autograd for its task id while traced)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    cb = GradientNoiseScale()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, callbacks=[cb],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(torch.compile(Root(), backend="aot_eager"), DataLoader(dataset(), batch_size=B))
        assert counters["stats"]["calls_captured"] > 0
        breaks = " ".join(counters["graph_break"])
        assert "_current_graph_task_id" not in breaks and "_begin_step" in breaks
    finally:
        torch._dynamo.reset()
    expected = per_example_reference(3, net=Positions())
    assert [h["method"] for h in cb.history] == ["per_example"] * 3
    assert [h["b_simple"] for h in cb.history] == pytest.approx(expected, rel=1e-5)


def test_accumulate_grad_batches_uses_the_micro_batch_form_and_the_controller():
    ctl = BatchSizeController(init_batch=16, max_batch=256, lr_rule="sqrt", multiple_of=8)
    cb = GradientNoiseScale(controller=ctl)
    _, logger = fit(cb, 3, accumulate_grad_batches=2)
    net, ref = make_net(), GNSEstimator(beta=0.99)
    params = list(net.parameters())
    loader = iter(DataLoader(dataset(), batch_size=B))
    for _ in range(3):
        parts = [next(loader) for _ in range(2)]
        gs = [torch.autograd.grad(F.cross_entropy(net(x), y) / 2, params) for x, y in parts]
        mean = [a + b for a, b in zip(*gs)]
        small = sum(sum(float((2 * t).double().pow(2).sum()) for t in g) for g in gs) / 2
        ref.update_two_batch(small, sum(float(t.double().pow(2).sum()) for t in mean), B, 2 * B)
        with torch.no_grad():
            for p, g in zip(params, mean):
                p -= LR * g
    assert [h["method"] for h in cb.history] == ["micro_batch"] * 3
    assert abs(cb.history[-1]["b_simple"] - ref.b_simple) <= 1e-5 * abs(ref.b_simple)
    assert [h["batch_size"] for h in cb.history] == [2 * B] * 3
    # the controller was asked at each measured step: its proposal is logged and kept
    assert len(ctl.proposals) == 3
    assert logged(logger, "gns/proposed_batch")[-1] == cb.history[-1]["proposed_batch"]
    assert cb.history[-1]["proposed_batch"] % 8 == 0


# ---- the DDP strategy on 2 gloo processes -----------------------------------------------------------
WORLD, STEPS = 2, 3


def _ddp_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")      # processes made here, not by Lightning
    torch.set_num_threads(1)
    cb = GradientNoiseScale()
    module = Module(make_net())
    strategy = pl.strategies.DDPStrategy(process_group_backend="gloo",
                                         timeout=datetime.timedelta(seconds=60))
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=WORLD, strategy=strategy, logger=False,
                         callbacks=[cb], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, DataLoader(dataset(), batch_size=B))
    torch.save({"history": cb.history, "seen": module.seen}, f"{out}/{rank}.pt")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_strategy_two_gloo_processes(tmp_path):
    mp.start_processes(_ddp_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    res = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    net = make_net()
    params, ref = list(net.parameters()), GNSEstimator(beta=0.99)
    for step in range(STEPS):                                  # the batches each rank saw, by hand
        local = [torch.autograd.grad(F.cross_entropy(net(res[r]["seen"][step][0]), res[r]["seen"][step][1]),
                                     params) for r in range(WORLD)]
        mean = [sum(g[i] for g in local) / WORLD for i in range(len(params))]
        small = sum(sum(float(t.double().pow(2).sum()) for t in g) for g in local) / WORLD
        ref.update_two_batch(small, sum(float(t.double().pow(2).sum()) for t in mean), B, WORLD * B)
        with torch.no_grad():
            for p, g in zip(params, mean):
                p -= LR * g
    assert not torch.equal(res[0]["seen"][0][0], res[1]["seen"][0][0])   # the ranks had different data
    for r in range(WORLD):
        h = res[r]["history"]
        assert [e["method"] for e in h] == ["replica"] * STEPS and h[-1]["batch_size"] == WORLD * B
        assert abs(h[-1]["b_simple"] - ref.b_simple) <= 1e-5 * abs(ref.b_simple), (r, h[-1], ref)


class ShardedModule(Module):
    """``configure_model`` shards the net with FSDP2 over the strategy's data-parallel mesh."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for m in (self.net[0], self.net[3]):
            fully_shard(m, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class TensorParallelModule(Module):
    """``configure_model`` splits both Linears column-wise over the strategy's tensor-parallel mesh, their
    outputs gathered (the LayerNorm between them needs its input whole)."""

    def configure_model(self):
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        col = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(self.net, self.device_mesh["tensor_parallel"], {"0": col, "3": col})


def _fsdp2_worker(rank, port, out, tp=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    cb, module = GradientNoiseScale(), (TensorParallelModule if tp else ShardedModule)(make_net())
    dp = 1 if tp else WORLD
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=WORLD // dp,
                                                   process_group_backend="gloo",
                                                   timeout=datetime.timedelta(seconds=60))
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=WORLD, strategy=strategy, logger=False,
                         callbacks=[cb], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    try:
        trainer.fit(module, DataLoader(dataset(), batch_size=B))
        torch.save({"history": cb.history, "seen": module.seen}, f"{out}/{rank}.pt")
        torch.distributed.barrier()
    finally:                 # the process group left by the strategy: gloo's threads may abort the exit
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_model_parallel_strategy_two_gloo_processes(tmp_path):
    """Lightning's ModelParallelStrategy with FSDP2 (``fully_shard`` in ``configure_model``): per example over
    the 2 ranks' batches, equal to torch.func's norms and the global mean gradient of the batches each rank
    saw (before: the root's forward never runs there, no backward was seen, every step unmeasured)."""
    from elasticlab.gns.reference import func_sq_norms
    mp.start_processes(_fsdp2_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    res = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    net = make_net()
    params, ref = list(net.parameters()), GNSEstimator(beta=0.99)
    for step in range(STEPS):
        x = torch.cat([res[r]["seen"][step][0] for r in range(WORLD)])
        y = torch.cat([res[r]["seen"][step][1] for r in range(WORLD)])
        sq = func_sq_norms(net, F.cross_entropy, x, y)
        mean = torch.autograd.grad(F.cross_entropy(net(x), y), params)
        ref.update_per_example(float(sq.double().mean()), len(x), sum(float(g.double().pow(2).sum())
                                                                      for g in mean))
        with torch.no_grad():
            for p, g in zip(params, mean):
                p -= LR * g
    assert not torch.equal(res[0]["seen"][0][0], res[1]["seen"][0][0])
    for r in range(WORLD):
        h = res[r]["history"]
        assert [e["method"] for e in h] == ["per_example"] * STEPS and h[-1]["batch_size"] == WORLD * B
        assert h[-1]["b_simple"] == pytest.approx(ref.b_simple, rel=1e-5), (r, h[-1], ref)


@pytest.mark.slow
def test_tensor_parallel_model_parallel_strategy_two_gloo_processes(tmp_path):
    """ModelParallelStrategy with tensor parallelism (``parallelize_module`` in ``configure_model``, a
    data-parallel size of 1): both ranks read the same batches, and the callback measures per example over
    them once, equal to one process (before: the layers were refused; without the strategy's data-parallel
    group, the monitor would have counted each example twice)."""
    mp.start_processes(_fsdp2_worker, args=(_free_port(), str(tmp_path), True), nprocs=WORLD,
                       start_method="spawn")
    res = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    assert torch.equal(res[0]["seen"][0][0], res[1]["seen"][0][0])
    net = make_net()
    params, ref = list(net.parameters()), GNSEstimator(beta=0.99)
    for x, y in res[0]["seen"][:STEPS]:
        with PerSampleGradNorms(net) as norms:
            F.cross_entropy(net(x), y).backward()
            ref.update_from(norms)
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
                p.grad = None
    for r in range(WORLD):
        h = res[r]["history"]
        assert [e["method"] for e in h] == ["per_example"] * STEPS and h[-1]["batch_size"] == B
        assert h[-1]["b_simple"] == pytest.approx(ref.b_simple, rel=1e-5), (r, h[-1], ref)


def test_deepcopy_free_callback_state_round_trip():
    cb = GradientNoiseScale()
    fit(cb, 2)
    again = GradientNoiseScale()
    again.load_state_dict(copy.deepcopy(cb.state_dict()))
    fit(again, 1)                                              # continues the restored estimate
    assert len(again.history) == 3 and again.monitor.estimator.num_updates == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, "every must be an integer >= 1, got 0"),
    ({"beta": 1.0}, r"beta must be in \[0, 1\), got 1.0"),
    ({"beta": float("nan")}, r"beta must be in \[0, 1\), got nan"),
    ({"method": "magic"}, "method must be one of .* got 'magic'"),
])
def test_callback_settings_are_checked_when_it_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):          # not at the fit's start, inside Lightning
        GradientNoiseScale(**kwargs)
