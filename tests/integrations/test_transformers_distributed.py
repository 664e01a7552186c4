"""transformers' own distributed training (``from_pretrained(..., distributed_config=DistributedConfig())``:
its FSDP2 plan, HSDP, its tensor parallelism, FSDP2 and tensor parallelism on a (fsdp, tp) mesh) on a tiny
LLaMA saved and loaded here, gloo processes on 127.0.0.1: the monitor's ‖ḡ‖² and tr(Σ) and every layer's
per-example norms against one process's on the whole batch, float64, tied and untied; pipeline and expert
parallelism refused by name.

Before: with ``fsdp_size`` and untied embeddings the first step raised "parameters ['weight'] are DTensors in
its forward (tensor parallelism)" for ``model.embed_tokens``: transformers' plan makes the input embedding an
FSDP2 unit of its own, which reshards its table after its forward, before the monitor's hook runs; and on
the 2-D mesh every layer's tensor-parallel layout went unread (transformers loads the weights into new
parameters after ``fully_shard``, so FSDP2's records did not know the module's parameter)."""
import functools

import pytest
import torch
from gloo_util import run_gloo

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

from elasticlab.gns import GNSEstimator, GNSMonitor, PerSampleGradNorms  # noqa: E402

T, B, VOCAB = 8, 4, 40          # B examples on each data-parallel rank


def ids(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, T), generator=torch.Generator().manual_seed(1))


def tiny(tied: bool):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=T, tie_word_embeddings=tied)).double()


def measure(model, x, **kw) -> dict:
    monitor = GNSMonitor(model, **kw)
    with monitor.step():
        model(input_ids=x, labels=x).loss.backward()
    model.zero_grad()
    with PerSampleGradNorms(model) as psn:
        model(input_ids=x, labels=x).loss.backward()
        h = monitor.history[0]
        return {k: h[k] for k in ("grad_sq", "trace_cov", "batch_size", "method")} | {
            "layers": psn.layer_sq_norms(), "total": psn.sq_norms()}


def load(path: str, cls=transformers.LlamaForCausalLM, **cfg):
    from transformers import DistributedConfig
    return cls.from_pretrained(path, distributed_config=DistributedConfig(**cfg), dtype=torch.float64)


def worker(rank, path, cfg):
    from torch.distributed.tensor import DTensor
    model = load(path, **cfg)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    tp = cfg.get("tp_size", 1)        # (transformers' mesh: ("pp", "dp_replicate", "fsdp", "tp"), in order)
    rows = slice(rank // tp * B, (rank // tp + 1) * B)
    out = measure(model, ids(DP(cfg) * B)[rows])           # (the data-parallel group: found by the monitor)
    return out | {"rows": (rows.start, rows.stop), "sharded": sharded}


def DP(cfg: dict) -> int:
    return cfg["fsdp_size"] * cfg.get("dp_replicate_size", 1)


@pytest.mark.parametrize("cfg,tied", [({"fsdp_size": 2}, False), ({"fsdp_size": 2}, True),
                                      ({"fsdp_size": 2, "tp_size": 2}, False),
                                      ({"fsdp_size": 2, "tp_size": 2}, True),
                                      ({"fsdp_size": 2, "dp_replicate_size": 2}, False)])     # HSDP
def test_hf_distributed_config_matches_one_process(tmp_path, cfg, tied):
    model = tiny(tied)
    model.save_pretrained(tmp_path / "model")
    ref = measure(model, ids(DP(cfg) * B))
    (tmp_path / "out").mkdir()
    world = DP(cfg) * cfg.get("tp_size", 1)
    res = run_gloo(functools.partial(worker, path=str(tmp_path / "model"), cfg=cfg), world, tmp_path / "out")
    assert len({r["rows"] for r in res}) == DP(cfg)          # (the tp ranks of a dp rank alike)
    for r in res:
        rows = slice(*r["rows"])
        assert r["sharded"] and r["method"] == "per_example" and r["batch_size"] == ref["batch_size"]
        for k in ("grad_sq", "trace_cov"):
            assert r[k] == pytest.approx(ref[k], rel=1e-9), k
        assert set(r["layers"]) == set(ref["layers"]) and ("lm_head" in r["layers"]) != tied
        for name, v in ref["layers"].items():
            torch.testing.assert_close(r["layers"][name], v[rows], rtol=1e-9, atol=0, msg=name)
        torch.testing.assert_close(r["total"], ref["total"][rows], rtol=1e-9, atol=0)


def refused(rank, path, cfg):
    try:
        GNSMonitor(load(path, transformers.MixtralForCausalLM, **cfg))
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("cfg", [{"pp_size": 2}, {"fsdp_size": 2, "ep_size": 2}])
def test_pipeline_and_expert_parallelism_refused_by_name(tmp_path, cfg):
    """Before: expert parallelism refused on the first forward as "tensor parallelism"; pipeline stages
    would have been measured each on its own layers."""
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)).save_pretrained(
            tmp_path / "model")
    (tmp_path / "out").mkdir()
    name = next(iter(set(cfg) - {"fsdp_size"}))
    body = functools.partial(refused, path=str(tmp_path / "model"), cfg=cfg)
    for msg in run_gloo(body, 2, tmp_path / "out"):
        assert msg is not None and f"DistributedConfig({name}=2)" in msg, msg
        assert ("pipeline" if name == "pp_size" else "expert") in msg


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        x = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def trainer_worker(rank, path, out, accum):
    """HF Trainer (launched as torchrun would: RANK, LOCAL_RANK, WORLD_SIZE) on the model loaded with
    DistributedConfig(fsdp_size=2), learning rate 0, ``accum`` micro-batches a step, with the GNS callback:
    its estimates and the micro-batches. The gradient clipped to 1e-3 before the callback's step end
    (before: ‖ḡ‖² read after the clipping)."""
    import os

    from elasticlab.integrations.transformers import GradientNoiseScaleCallback
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    model, seen, cb = load(path, fsdp_size=2), [], GradientNoiseScaleCallback()
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=f"{out}/{rank}", per_device_train_batch_size=B, max_steps=3, learning_rate=0.0,
        gradient_accumulation_steps=accum, max_grad_norm=1e-3, report_to=[], use_cpu=True, logging_steps=1,
        save_strategy="no", disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb]).train()
    keys = ("grad_sq", "trace_cov", "batch_size", "micro_batches", "method")
    return {"history": [{k: h[k] for k in keys} for h in cb.history], "seen": seen}


@pytest.mark.parametrize("accum", [1, 2])
def test_hf_trainer_callback_on_a_distributed_config_model(tmp_path, accum):
    """Each step per example over the processes' micro-batches (FSDP2: the micro-batch form's whole
    gradients are reduced away), against the estimator fed by one process: the mean ‖g_i‖² of the step's
    2·accum·B examples and ‖ḡ‖² of their mean gradient (equal micro-batches: B_big = 2·accum·B)."""
    model = tiny(False)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "out").mkdir()
    body = functools.partial(trainer_worker, path=str(tmp_path / "model"), out=str(tmp_path / "out"),
                             accum=accum)
    res = run_gloo(body, 2, tmp_path / "out")
    assert all(len(r["seen"]) == 3 * accum for r in res)
    assert not torch.equal(res[0]["seen"][0], res[1]["seen"][0])         # (the Trainer shards the data)
    est = GNSEstimator(beta=0.99)                          # (history: the estimator's running values)
    for k in range(3):
        x = torch.cat([r["seen"][k * accum + j] for j in range(accum) for r in res])
        model.zero_grad()
        with PerSampleGradNorms(model) as psn:
            model(input_ids=x, labels=x).loss.backward()
            est.update_two_batch(float(psn.sq_norms().mean()), psn.grad_sq_norm(), 1.0, float(len(x)))
        for r in res:
            h = r["history"][k]
            assert h["method"] == "per_example" and h["batch_size"] == 2 * accum * B
            assert h["micro_batches"] == accum
            assert h["grad_sq"] == pytest.approx(est.grad_sq, rel=1e-9), k
            assert h["trace_cov"] == pytest.approx(est.trace_cov, rel=1e-9), k
