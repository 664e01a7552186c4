"""Hugging Face causal LMs (tiny GPT-2 and LLaMA built from configs, nothing downloaded) under FSDP2: each
block and the whole model ``fully_shard``-ed, 2 gloo processes on 127.0.0.1, against one process on the
union of their batches. Tied input and output embeddings are the case that failed: the output layer owns no
parameter of its own, so it had no per-example rows while its (empty) gradient sum was still listed, and
the step ended in a KeyError naming ``lm_head``."""
import functools

import pytest
import torch
from gloo_util import run_gloo

transformers = pytest.importorskip("transformers")
fsdp = pytest.importorskip("torch.distributed.fsdp")

from elasticlab.gns import GNSMonitor  # noqa: E402

T, V, B_LOCAL, WORLD, STEPS = 12, 40, 3, 2, 3


def tiny(kind: str, tied: bool):
    """The model (float64, no dropout) and its list of blocks."""
    torch.manual_seed(0)
    if kind == "gpt2":
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_head=2, n_embd=16, vocab_size=V, n_positions=T, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=tied))
        return m.double(), m.transformer.h
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=T, tie_word_embeddings=tied))
    return m.double(), m.model.layers


def train(model, rows) -> dict:
    """SGD steps on this process's ``rows`` of each batch, under GNSMonitor (per layer, its default)."""
    g = torch.Generator().manual_seed(3)
    monitor, opt = GNSMonitor(model), torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        ids = torch.randint(0, V, (WORLD * B_LOCAL, T), generator=g)[rows]
        opt.zero_grad()
        with monitor.step():
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return {k: [h[k] for h in monitor.history] for k in ("b_simple", "method", "batch_size")} \
        | {"layers": monitor.layer_b_simple()}


def worker(rank, kind, tied, compiled):
    """``compiled``: each block compiled before it is sharded (torchtitan's order), aot_eager."""
    import torch._dynamo
    torch.set_num_threads(1)
    torch._dynamo.reset()
    model, blocks = tiny(kind, tied)
    for block in blocks:
        if compiled:
            block.compile(backend="aot_eager")
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    try:
        return train(model, slice(rank * B_LOCAL, (rank + 1) * B_LOCAL))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("kind,tied,compiled", [("gpt2", True, False), ("gpt2", False, False),
                                                ("llama", True, False), ("gpt2", True, True)])
def test_fsdp2_hf_causal_lm_matches_one_process(tmp_path, kind, tied, compiled):
    res = run_gloo(functools.partial(worker, kind=kind, tied=tied, compiled=compiled), WORLD, tmp_path)
    ref = train(tiny(kind, tied)[0], slice(None))
    assert ref["method"] == ["per_example"] * STEPS
    embed = "transformer.wte" if kind == "gpt2" else "model.embed_tokens"
    assert embed in ref["layers"] and ("lm_head" in ref["layers"]) is not tied     # tied: counted once
    for r in res:
        assert r["method"] == ["per_example"] * STEPS and r["batch_size"] == [WORLD * B_LOCAL] * STEPS
        assert r["b_simple"] == pytest.approx(ref["b_simple"], rel=1e-9)
        assert set(r["layers"]) == set(ref["layers"])
        assert r["layers"] == pytest.approx(ref["layers"], rel=1e-9)
