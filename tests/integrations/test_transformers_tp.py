"""Hugging Face's own tensor parallelism (``from_pretrained(...,
distributed_config=DistributedConfig(tp_size=2))``: transformers' parallel styles, which replace a layer's
forward rather than hook it as ``parallelize_module`` does) on tiny causal LMs saved and loaded here, 2 gloo
processes on 127.0.0.1: the per-example norms of every layer and the monitor's ‖ḡ‖² and tr(Σ) against one
process's, float64.

Before: LLaMA's output layer's norms were twice the truth, silently (its style, ``colwise_gather_output``,
gathers the vocabulary inside the forward, so each process's hooks saw the whole output gradient against its
half of the weight, and the halves' norms were then summed); Gemma's scaled embedding raised from deep inside
(``aten.embedding`` on mixed tensors); Qwen3's per-head ``q_norm``/``k_norm``
(``replicated_with_grad_allreduce``: each process's gradient covers its heads only) were 0.4-0.7x the truth,
silently (their per-example gradients are now summed over the processes before the norm); a tied table
split by tensor parallelism about 1.4x (then refused by name; now each process forms the tied table's three
terms on its rows of the vocabulary)."""
import functools

import pytest
import torch
from gloo_util import run_gloo

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.tensor.parallel")

from elasticlab.gns import GNSMonitor, PerSampleGradNorms  # noqa: E402

T, B, WORLD = 8, 4, 2


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(1))


def norms(model, vocab: int) -> dict:
    with PerSampleGradNorms(model) as psn:
        x = ids(vocab)
        model(input_ids=x, labels=x).loss.backward()
        return {"layers": psn.layer_sq_norms(), "total": psn.sq_norms(), "grad_sq": psn.grad_sq_norm()}


#: family: (model class, config class, its settings); qwen2: q, k, v biases; gemma: a scaled embedding;
#: phi3: packed q/k/v, gathered outputs; qwen3: per-head norms whose gradient each process holds a part of
FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),
    "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig, {"head_dim": 4}),
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config, {"pad_token_id": 0}),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"head_dim": 4}),
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                 {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "head_dim": 4})}
#: mixtures of experts (their plans split the attention; the experts, replicated, are run one by one:
#: loaded with a distributed_config they would take the CPU's grouped_mm, which has no float64)
MOE = {"mixtral": {"experts_implementation": "eager"}, "qwen3moe": {"experts_implementation": "eager"}}


def tiny(kind: str, vocab: int = 40, tied: bool = False):
    """A 2-layer model of the family ``kind`` (4 query heads, 2 key-value heads), float64."""
    torch.manual_seed(0)
    model, config, extra = FAMILIES[kind]
    model = model(config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                         tie_word_embeddings=tied, **extra)).double()
    if kind in MOE:
        model.set_experts_implementation(MOE[kind]["experts_implementation"])
    return model


def load(path: str, kind: str):
    from transformers import DistributedConfig  # (the model's own plan, as tp_plan="auto")
    return FAMILIES[kind][0].from_pretrained(path, distributed_config=DistributedConfig(tp_size=WORLD),
                                             dtype=torch.float64, **MOE.get(kind, {}))


def worker(rank, path, kind, vocab, tied):
    from torch.distributed.tensor import DTensor
    torch.set_num_threads(1)
    model = load(path, kind)
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    dp = [torch.distributed.new_group([r]) for r in range(WORLD)][rank]     # TP alone: data-parallel of 1
    monitor = GNSMonitor(model, process_group=dp)
    x = ids(vocab)
    with monitor.step():
        model(input_ids=x, labels=x).loss.backward()
    model.zero_grad()
    return norms(model, vocab) | {"sharded": sharded, "monitor": monitor.history[0]}


@pytest.mark.parametrize("kind,vocab,tied", [
    ("llama", 40, False), ("llama", 41, False), ("qwen2", 40, False), ("gemma", 40, False),
    ("phi3", 40, False), ("qwen3", 40, False),                             # 41: the vocabulary split 21 + 20
    ("mixtral", 40, False), ("qwen3moe", 40, False),
    ("llama", 40, True), ("llama", 41, True), ("gemma", 40, True)])        # tied: the table's rows split
def test_hf_tensor_parallel_norms_match_one_process(tmp_path, kind, vocab, tied):
    """Tied (the embedding's table is the output layer's weight, split along the vocabulary): before, refused
    by name (and about 1.4x the truth before that refusal)."""
    model = tiny(kind, vocab, tied)
    model.save_pretrained(tmp_path / "model")
    monitor = GNSMonitor(model)
    with monitor.step():
        x = ids(vocab)
        model(input_ids=x, labels=x).loss.backward()
    model.zero_grad()
    ref = norms(model, vocab)
    (tmp_path / "out").mkdir()
    body = functools.partial(worker, path=str(tmp_path / "model"), kind=kind, vocab=vocab, tied=tied)
    for r in run_gloo(body, WORLD, tmp_path / "out"):
        assert r["sharded"] >= 6                   # (the attention's and the MLP's projections of 2 layers)
        assert set(r["layers"]) == set(ref["layers"]) and ("lm_head" in r["layers"]) != tied
        for name, v in ref["layers"].items():
            torch.testing.assert_close(r["layers"][name], v, rtol=1e-9, atol=0, msg=name)
        torch.testing.assert_close(r["total"], ref["total"], rtol=1e-9, atol=0)
        assert r["grad_sq"] == pytest.approx(ref["grad_sq"], rel=1e-9)
        assert r["monitor"]["batch_size"] == B     # (the processes' examples are the same ones)
        for k in ("grad_sq", "trace_cov"):         # (McCandlish Eq. A.2; B_simple: inf, ‖G‖² < 0 on B=4)
            assert r["monitor"][k] == pytest.approx(monitor.history[0][k], rel=1e-9), k
