"""The Hugging Face Trainer callback on a tiny GPT-2 (built from a config, nothing downloaded) against
GNSEstimator fed the same batches by hand: per-example (GPT-2's Conv1D rule), gradient accumulation."""
import copy
import gc
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from layer_check import against_per_example  # noqa: E402

from elasticlab.gns import GNSEstimator, PerSampleGradNorms  # noqa: E402
from elasticlab.gns.reference import example_param_sq_norms  # noqa: E402
from elasticlab.integrations.transformers import GradientNoiseScaleCallback  # noqa: E402

T, V, B, WORLD = 12, 40, 4, 2


def tiny_gpt2(tied=False):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=V, n_positions=T,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, V, (T,), generator=g)
        # positions per example (not needed since the embedding of (1, T) positions is followed to its
        # broadcast, gns.layers.broadcast_params; kept so that these tests see the batched index too)
        return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(T)}


class TokensWithoutPositions(Tokens):
    """The model makes its positions, (1, T), broadcast over the batch."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        del item["position_ids"]
        return item


def train(tmp_path, callback, steps, accum=1, model=None, data=None, **arguments):
    model = model or tiny_gpt2()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=B, gradient_accumulation_steps=accum,
        max_steps=steps, learning_rate=0.0, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, **arguments)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data or Tokens(),
                                   callbacks=[callback])
    trainer.train()
    return trainer, seen


def loss_of(model, ids, scale=1.0):
    pos = torch.arange(T).expand(ids.shape[0], -1)
    return model(input_ids=ids, labels=ids, position_ids=pos).loss * scale


def estimates(model, seen, loss, ref=None):
    """B_simple after each of the batches ``seen``, by GNSEstimator (``ref``, else a new one) on
    PerSampleGradNorms of ``model`` (learning rate 0 in these runs: the model stays put);
    ``loss(model, ids)``."""
    ref, out = ref or GNSEstimator(beta=0.99), []
    with PerSampleGradNorms(model) as norms:
        for ids in seen:
            model.zero_grad()
            loss(model, ids).backward()
            ref.update_from(norms)
            out.append(ref.b_simple)
    return out


def test_tiny_gpt2_per_example_matches_the_estimator(tmp_path):
    cb = GradientNoiseScaleCallback(log_layers=True)
    model = tiny_gpt2()
    ref_model = copy.deepcopy(model)                           # learning rate 0: the model stays put
    trainer, seen = train(tmp_path, cb, 3, model=model)
    assert len(seen) == 3 and all(s.shape == (B, T) for s in seen)
    expected = estimates(ref_model, seen, loss_of)
    got = [h["b_simple"] for h in cb.history]
    assert [h["method"] for h in cb.history] == ["per_example"] * 3       # Conv1D covered by its rule
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=0)
    logged = [e for e in trainer.state.log_history if "gns/b_simple" in e]
    assert [e["step"] for e in logged] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor([e["gns/b_simple"] for e in logged]), torch.tensor(expected),
                               rtol=1e-4, atol=0)
    assert any(k.startswith("gns/layer/transformer.h.0.attn.c_attn") for k in logged[-1])


class Repeats(Tokens):
    """A token repeated along each sequence: a signal the examples share, so that ‖G‖² > 0 and B_simple is
    finite in a few steps (random tokens leave it infinite)."""

    def __getitem__(self, i):
        return {"input_ids": torch.full((T,), i % 3), "labels": torch.full((T,), i % 3)}


def test_trainer_bf16_within_2_percent_of_float32(tmp_path):
    """``TrainingArguments(bf16=True)`` (Accelerate's bf16 autocast, here on the CPU): every step measured
    per example, each estimate within 2% of a float32 run's on the same batches (learning rate 0)."""
    runs = []
    for bf16 in (False, True):
        cb = GradientNoiseScaleCallback()
        trainer, _ = train(tmp_path / str(bf16), cb, 3, bf16=bf16)
        runs.append(cb.history)
    assert trainer.accelerator.mixed_precision == "bf16"
    for lo, hi in zip(runs[1], runs[0]):
        assert lo["method"] == hi["method"] == "per_example"
        for k in ("b_simple", "grad_sq", "trace_cov"):
            assert lo[k] == pytest.approx(hi[k], rel=0.02) and lo[k] != hi[k], k    # (equal: no bf16 used)


def _ddp_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))    # processes made here
    torch.set_num_threads(1)
    cb = GradientNoiseScaleCallback(log_layers=True)
    try:
        _, seen = train(out, cb, 3, data=Repeats(), ddp_backend="gloo")
        torch.save({"history": cb.history, "seen": seen}, f"{out}/{rank}.pt")
        torch.distributed.barrier()
    finally:                 # the Trainer leaves its process group: gloo's threads may abort the exit
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ddp_two_gloo_processes_per_example_and_per_layer(tmp_path):
    """The Trainer under DDP (2 gloo processes): the callback sees the plain model on the process group, so
    per example over both ranks' batches, per layer too (before: no per-layer estimates there), equal to one
    process on the union of the batches each rank saw."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ddp_worker, args=(port, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    res = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    assert not torch.equal(res[0]["seen"][0], res[1]["seen"][0])         # the ranks had different data
    ref = GNSEstimator(beta=0.99)
    union = [torch.cat([r["seen"][i] for r in res]) for i in range(3)]
    expected = estimates(tiny_gpt2(), union, loss_of, ref)
    assert all(0 < e < float("inf") for e in expected)
    for r in res:
        h = r["history"]
        assert [e["method"] for e in h] == ["per_example"] * 3 and h[-1]["batch_size"] == WORLD * B
        assert [e["b_simple"] for e in h] == pytest.approx(expected, rel=1e-4)
        layers = ref.layer_b_simple()
        assert "transformer.h.0.attn.c_attn" in h[-1]["layers"] and set(h[-1]["layers"]) == set(layers)
        assert h[-1]["layers"] == pytest.approx(layers, rel=1e-4)


def test_trainer_with_torch_compile_measures_every_step_per_example(tmp_path):
    """HF Trainer with ``torch_compile=True`` (aot_eager) and the model making its own positions: the
    callback's first step runs eagerly (eager_first), the later ones compiled, each per example with the
    estimates of an eager run on the same batches (before: GNSMonitor raised at the first step, naming
    transformer.wpe)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    cb = GradientNoiseScaleCallback()
    model = tiny_gpt2()
    ref_model = copy.deepcopy(model)
    trainer, seen = train(tmp_path, cb, 3, model=model, data=TokensWithoutPositions(), torch_compile=True,
                          torch_compile_backend="aot_eager")
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule" and len(seen) == 3
    assert counters["stats"]["calls_captured"] > 0          # (the later steps traced)
    torch._dynamo.reset()
    expected = estimates(ref_model, seen, lambda m, ids: m(input_ids=ids, labels=ids).loss)
    assert [h["method"] for h in cb.history] == ["per_example"] * 3
    torch.testing.assert_close(torch.tensor([h["b_simple"] for h in cb.history]), torch.tensor(expected),
                               rtol=1e-4, atol=0)


def test_tiny_gpt2_gradient_accumulation_and_tied_weights(tmp_path):
    cb = GradientNoiseScaleCallback()
    model = tiny_gpt2(tied=True)                               # GPT-2's default: embedding = output layer
    ref_model = copy.deepcopy(model)
    _, seen = train(tmp_path, cb, 2, accum=2, model=model)
    assert len(seen) == 4
    params = [p for p in ref_model.parameters() if p.requires_grad]
    ref = GNSEstimator(beta=0.99)
    for step in range(2):
        parts = seen[2 * step:2 * step + 2]
        gs = [torch.autograd.grad(loss_of(ref_model, ids, 0.5), params) for ids in parts]
        mean = [a + b for a, b in zip(*gs)]
        small = sum(sum(float((2 * t).double().pow(2).sum()) for t in g) for g in gs) / 2
        ref.update_two_batch(small, sum(float(t.double().pow(2).sum()) for t in mean), B, 2 * B)
    assert [h["method"] for h in cb.history] == ["micro_batch"] * 2
    assert abs(cb.history[-1]["b_simple"] - ref.b_simple) <= 1e-4 * abs(ref.b_simple), (cb.history, ref)
    # one backward per step: per-example norms, the tied table's with the cross term of its two uses
    one = GradientNoiseScaleCallback()
    train(tmp_path, one, 1, model=tiny_gpt2(tied=True))
    assert [h["method"] for h in one.history] == ["per_example"]


def test_tiny_gpt2_tied_per_example_norms_match_one_backward_per_example():
    model = tiny_gpt2(tied=True).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    with PerSampleGradNorms(model) as norms:
        loss_of(model, ids).backward()
        got = norms.sq_norms()
    ref = example_param_sq_norms(model, (loss_of(model, ids[i:i + 1]) for i in range(B)))
    torch.testing.assert_close(got, sum(ref.values()), rtol=1e-8, atol=0)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_tiny_gpt2_gradient_checkpointing_per_example_norms(tied, reentrant):
    """``gradient_checkpointing_enable()``: each block runs again in the backward (HF's checkpoint, reentrant
    or not); the norms are those of one backward per example without it (before: "ran 2 times")."""
    model = tiny_gpt2(tied=tied).double()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    ref = example_param_sq_norms(model, (loss_of(model, ids[i:i + 1]) for i in range(B)))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    with PerSampleGradNorms(model) as norms:
        loss_of(model, ids).backward()
        got = norms.sq_norms()
    torch.testing.assert_close(got, sum(ref.values()), rtol=1e-8, atol=0)


def test_tiny_llama_per_example_norms_with_its_own_rmsnorm():
    """LLaMA's LlamaRMSNorm is its own class (no registered rule): the generic rule (torch.func) covers it,
    and the model's norms match one backward per example (before: "no per-example gradient-norm rule")."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T)
    model = transformers.LlamaForCausalLM(cfg).double()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))

    _, got, _ = against_per_example(model, lambda s: model(input_ids=ids[s], labels=ids[s]).loss, B,
                                    atol=1e-20, same_keys=False)
    assert "model.norm.weight" in got and "model.layers.0.input_layernorm.weight" in got


@pytest.mark.parametrize("kwargs, message", [
    ({"every": 0}, "every must be an integer >= 1, got 0"),
    ({"beta": -0.1}, r"beta must be in \[0, 1\), got -0.1"),
    ({"method": "magic"}, "method must be one of .* got 'magic'"),
])
def test_callback_settings_are_checked_when_it_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):          # not when the Trainer starts training
        GradientNoiseScaleCallback(**kwargs)


def _masked_lm_norms_match(model, fused, steps):
    """sq_norms at each of ``steps`` steps (the same batch) against one backward per example, position ids
    expanded over the batch; the per-step results (None where the step was NaN) and the warnings."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))

    def loss(i):
        return model(input_ids=i, labels=i, position_ids=torch.arange(T).expand(i.shape[0], -1)).loss
    want = sum(example_param_sq_norms(model, (loss(ids[i:i + 1]) for i in range(B))).values())
    out = []
    with PerSampleGradNorms(model, fused=fused) as norms:
        for _ in range(steps):
            model.zero_grad()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                loss(ids).backward()
                got = norms.sq_norms()
            if torch.isnan(got).all():
                out.append((None, w))
            else:
                torch.testing.assert_close(got, want, rtol=1e-8, atol=0)
                out.append((got, w))
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_tiny_albert_shared_layer_per_example_norms(fused):
    """ALBERT (Lan et al. 2020) runs one layer at every depth: each of its modules is called
    num_hidden_layers times in a forward, so their per-example gradients are sums over the calls
    (gns.repeated; before: "ran 3 times in one forward"). Its masked-LM head's bias is its decoder's
    (an alias, counted once), and the decoder is tied to the word embeddings. Exact from the first step,
    hooks and fused alike (the first step keeps the fused calls: gns.repeated.watch), with no warning."""
    torch.manual_seed(0)
    cfg = transformers.AlbertConfig(vocab_size=V, embedding_size=8, hidden_size=16, num_hidden_layers=3,
                                    num_attention_heads=2, intermediate_size=32, max_position_embeddings=T,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.AlbertForMaskedLM(cfg).double()
    assert model.predictions.bias is model.predictions.decoder.bias
    (first, warned), (second, again) = _masked_lm_norms_match(model, fused, 2)
    assert second is not None and not again
    assert first is not None and not warned


def test_tiny_bert_masked_lm_with_its_aliased_bias():
    """BERT's prediction head holds the decoder's bias as a parameter of its own (the same tensor): it is
    the decoder Linear's, not an uncovered parameter (before: "no per-example gradient-norm rule for module
    'cls.predictions'")."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=T, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(cfg).double()
    assert model.cls.predictions.bias is model.cls.predictions.decoder.bias
    ((got, warned),) = _masked_lm_norms_match(model, True, 1)
    assert got is not None and not warned


def _tiny_vit_config(**kw):
    return transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                  num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                  num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  **kw)


@pytest.mark.parametrize("fused", [False, True])
def test_tiny_vit_class_token_and_position_embeddings(fused):
    """ViTEmbeddings' bare ``cls_token`` and ``position_embeddings`` (before: "no per-example gradient-norm
    rule for module 'vit.embeddings' of type ViTEmbeddings" under strict, left out without), followed to
    their broadcast over the batch (gns.layers.broadcast_params): at the trained size, and at a larger image
    whose position embeddings are interpolated (a tensor made from them, mapped back by a batched vjp)."""
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(_tiny_vit_config()).double()
    y = torch.randint(0, 3, (B,))
    for size, interp in ((8, False), (12, True)):
        x = torch.randn(B, 3, size, size, dtype=torch.float64)

        def loss(i, x=x, interp=interp):
            return model(pixel_values=x[i], labels=y[i], interpolate_pos_encoding=interp).loss
        # (atol: the key bias's per-example gradient is 0 up to rounding: the softmax is shift-invariant)
        against_per_example(model, loss, B, atol=1e-24, fused=fused)


def test_tiny_vit_masked_image_modeling_mask_token():
    """SimMIM-style pretraining (ViTForMaskedImageModeling): the mask token is expanded over the batch and
    mixed in where the patches are masked."""
    torch.manual_seed(0)
    model = transformers.ViTForMaskedImageModeling(_tiny_vit_config(encoder_stride=4)).double()
    x = torch.randn(B, 3, 8, 8, dtype=torch.float64)
    # two of the four patches masked in every example: the loss divides by the batch's masked count (+1e-5),
    # so only with equal counts is it the mean of the examples' own losses (to ~1e-5: hence rtol 1e-4)
    mask = torch.rand(B, 4, generator=torch.Generator().manual_seed(1)).argsort(1) < 2

    def loss(i):
        return model(pixel_values=x[i], bool_masked_pos=mask[i]).loss
    want = against_per_example(model, loss, B, rtol=1e-4, atol=1e-24, same_keys=False)[2]
    assert want["vit.embeddings.mask_token"].min() > 0


def _sq_norms_match(model, loss, reduction="mean"):
    """sq_norms of one step against one backward per example of ``loss(index)``."""
    want = sum(example_param_sq_norms(model, (loss(slice(b, b + 1)) for b in range(B))).values())
    with PerSampleGradNorms(model, loss_reduction=reduction) as norms:
        loss(slice(None)).backward()
        torch.testing.assert_close(norms.sq_norms(), want, rtol=1e-8, atol=0)


def test_models_building_their_own_position_ids():
    """Without position_ids, GPT-2 and BERT embed ``arange(T)`` of shape (1, T) (BERT from a buffer), which
    the model's input does not carry; the embedding is followed to its broadcast over the batch
    (gns.layers.broadcast_params; before: the readers raised "module 'transformer.wpe' (Embedding) ...
    broadcast over the batch", which only passing expanded position_ids avoided)."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    gpt = tiny_gpt2().double()
    _sq_norms_match(gpt, lambda i: gpt(input_ids=ids[i], labels=ids[i]).loss)
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=T, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()
    _sq_norms_match(bert, lambda i: bert(input_ids=ids[i], labels=ids[i]).loss)


@pytest.mark.parametrize("attn, flan", [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_tiny_t5_relative_attention_bias(attn, flan):
    """T5's relative-position bias: an embedding of (q, k) buckets made inside the model, (1, H, q, k) after
    a permute, the attention mask of SDPA or added in place to the scores (before: no way out). Its token
    table is shared by ``shared``, the encoder's and decoder's embeddings and the output layer (gns.tied;
    before: "parameter 'shared.weight' is also ... (tied weights)"); FLAN-T5's layout (T5 v1.1) unties the
    output layer and gates its feed-forward."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                dropout_rate=0.0, relative_attention_num_buckets=8, decoder_start_token_id=0,
                                attn_implementation=attn, tie_word_embeddings=not flan,
                                feed_forward_proj="gated-gelu" if flan else "relu")
    model = transformers.T5ForConditionalGeneration(cfg).double()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    _, got, want = against_per_example(model, lambda s: model(input_ids=ids[s], labels=ids[s]).loss, B,
                                       atol=1e-24, same_keys=False)
    assert want[bias].min() > 0 and "shared.weight" in got


def test_tiny_clip_vision_class_embedding_and_positions():
    """CLIP's vision embeddings: a bare class embedding (D,) expanded over the batch, and an nn.Embedding on
    its position_ids buffer (1, N)."""
    torch.manual_seed(0)
    model = transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
        patch_size=4, projection_dim=8)).double()
    x = torch.randn(B, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    _sq_norms_match(model, lambda i: model(pixel_values=x[i]).image_embeds.pow(2).sum(), reduction="sum")


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_bart_learned_positions(tied):
    """BART's positional embedding, an nn.Embedding subclass with a forward of its own (the generic rule),
    handed its positions by keyword in the decoder: an output of shape (1, T, D), followed to its broadcast
    (before: "vmap: Expected at least one Tensor to vmap over"). Its word embeddings scale the lookup
    (gns.layers.embedding.scale_of), and by default share their table with ``shared`` and the output layer
    (before: refused as tied weights)."""
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=T,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, tie_word_embeddings=tied,
        scale_embedding=True)).double()
    ids = torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(5))
    _sq_norms_match(model, lambda i: model(input_ids=ids[i], labels=ids[i]).loss)


def test_tiny_gemma_scaled_and_tied_embedding():
    """Gemma's word embedding scales the lookup by √D and is tied to the output layer (before: refused as tied
    weights; untied, the generic rule: B per-example tables at once)."""
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(transformers.GemmaConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, intermediate_size=32, max_position_embeddings=T)).double()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(6))
    _sq_norms_match(model, lambda i: model(input_ids=ids[i], labels=ids[i]).loss)


def test_tiny_whisper_positions():
    """Whisper: the encoder adds its positional table to every example (an nn.Embedding subclass on
    ``arange``, followed to its broadcast), the decoder's reads its positions passed by keyword (the generic
    rule sees keyword arguments; before: "... the generic one (torch.func) does not apply: its output for an
    example depends on the other examples of the batch", each example's forward having run without them)."""
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=V, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_source_positions=8, max_target_positions=T, decoder_start_token_id=0, pad_token_id=0,
        dropout=0.0)).double()
    feats = torch.randn(B, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ids = torch.randint(1, V, (B, T - 1), generator=torch.Generator().manual_seed(8))
    _sq_norms_match(model, lambda i: model(input_features=feats[i], labels=ids[i]).loss)


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_tiny_mixtral_experts_and_router(experts):
    """Mixtral's sparse block as Hugging Face runs it by default (``grouped_mm``: the routed tokens sorted by
    expert in one grouped matmul) and eagerly (F.linear expert by expert): the experts' (E, 2I, D) weights
    and the router match one backward per example (float32: the CPU's grouped_mm takes no float64)."""
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T,
                                     num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg)
    model.set_experts_implementation(experts)
    assert model.config._experts_implementation == experts
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))

    _, got, _ = against_per_example(model, lambda s: model(input_ids=ids[s], labels=ids[s]).loss, B,
                                    rtol=2e-4, same_keys=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in got and "model.layers.1.mlp.gate.weight" in got


@pytest.mark.parametrize("arch", ["opt", "mixtral"])
def test_as_many_positions_as_examples(arch):
    """T = B: OPT's MLP on (B·T, D) and Mixtral's experts on the tokens folded from a (B, B, D) tensor, whose
    layout the view's shape no longer tells (either dim could be the batch): read further back in the graph
    (before: "layers disagree on the batch size", and the experts' weights refused)."""
    torch.manual_seed(0)
    if arch == "opt":
        model = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
            max_position_embeddings=T, dropout=0.0, word_embed_proj_dim=16))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=T, num_local_experts=4, num_experts_per_tok=2))
        model.set_experts_implementation("eager")              # (float64: the CPU's grouped_mm takes none)
    model = model.double()
    ids = torch.randint(0, V, (B, B), generator=torch.Generator().manual_seed(3))
    against_per_example(model, lambda s: model(input_ids=ids[s], labels=ids[s]).loss, B, atol=1e-24,
                        complete=True)


def test_t5_with_as_many_positions_as_examples():
    """T5's relative position bias is an Embedding on (T, T) buckets, broadcast over the batch; at T = B its
    input looks batched. Looked up over the batch at its attention's ``compute_bias`` (layers.bias_method),
    it is measured as at any other size (before: an error saying that the sizes meet by chance)."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                dropout_rate=0.0, relative_attention_num_buckets=8, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).double()
    ids = torch.randint(0, V, (B, B), generator=torch.Generator().manual_seed(3))
    against_per_example(model, lambda s: model(input_ids=ids[s], labels=ids[s]).loss, B, atol=1e-24,
                        same_keys=False, complete=True)


def test_tiny_swin_with_as_many_windows_a_side_as_examples():
    """Swin at B = 2 with 2 windows a side: the windows' fold is read past its (2, 2, …) view, and the
    relative position bias is followed as a broadcast over the windows (before: refused by name)."""
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=4,
        num_labels=2, drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1])
    against_per_example(model, lambda s: model(pixel_values=x[s], labels=y[s]).loss, 2, atol=1e-24,
                        complete=True)


@pytest.mark.parametrize("fused", [True, False])
def test_tiny_wavlm_attention_by_its_childrens_calls(fused):
    """WavLM hands its q/k/v/out projections' weights to F.multi_head_attention_forward (sequence first, the
    biases concatenated), gated by its relative position bias: run as the projections' own calls
    (gns.layers.mha_children; before: refused naming 'k_proj.bias')."""
    torch.manual_seed(0)
    cfg = transformers.WavLMConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, num_labels=2, num_buckets=8,
        max_bucket_distance=16)
    model = transformers.WavLMForSequenceClassification(cfg).double()
    audio = torch.randn(3, 400, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 1])
    _, got, _ = against_per_example(model, lambda s: model(input_values=audio[s], labels=labels[s]).loss, 3,
                                    rtol=1e-7, atol=1e-24, fused=fused, complete=True)
    assert "wavlm.encoder.layers.0.attention.k_proj.bias" in got


def padded_batch(pad, lens=(T, 8, 5, 3)):
    """Token ids padded as a collator pads them (``pad``: "right" or "left"), with the attention mask and
    language-model labels that are -100 at the pads."""
    ids = torch.randint(1, V, (len(lens), T), generator=torch.Generator().manual_seed(5))
    keep = torch.arange(T).expand(len(lens), -1) < torch.tensor(lens)[:, None]
    keep = keep if pad == "right" else keep.flip(1)
    return ids.masked_fill(~keep, 0), keep.long(), ids.masked_fill(~keep, -100)


@pytest.mark.parametrize("pad", ["right", "left"])
@pytest.mark.parametrize("arch, fused", [("gpt2", True), ("gpt2", False), ("llama", True), ("t5", True),
                                         ("bert", True)])
def test_padded_batches_with_an_attention_mask(arch, fused, pad):
    """A padded batch (attention mask, labels -100 at the pads): a language model's loss is a mean over the
    batch's counted tokens, so each example's gradient is that of its summed token loss over the batch's
    count (times B, the "mean" convention), from one backward per example at the same padding. The token
    loss is taken in float64 here: HF's own upcasts the logits to float32, which a float64 model then
    rounds (it is checked to agree to that precision). BERT's loss is per example (classification). B = 4:
    Llama's and T5's norms run in float32 inside the float64 model, so each example's gradient in the batch
    (1/B of its own) rounds there as its own does only when B is a power of 2 (at B = 3: 1e-6 apart)."""
    torch.manual_seed(0)
    shifted = True
    if arch == "gpt2":
        model = tiny_gpt2()
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=T))
    elif arch == "t5":
        shifted = False                                      # the decoder's inputs are the labels shifted
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
            relative_attention_num_buckets=8, decoder_start_token_id=0))
    else:
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=T, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model = model.double().train()
    ids, mask, labels = padded_batch(pad)
    n = ids.shape[0]
    if arch == "bert":
        y = torch.tensor([0, 1, 1, 0])
        loss_of = lambda s: model(input_ids=ids[s], attention_mask=mask[s], labels=y[s]).loss  # noqa: E731
    else:
        target = labels[:, 1:] if shifted else labels
        counted = int(target.ne(-100).sum())
        assert counted < target.numel()

        def loss_of(s):
            out = model(input_ids=ids[s], attention_mask=mask[s], labels=labels[s])
            logits = out.logits[:, :-1] if shifted else out.logits
            tokens = torch.nn.functional.cross_entropy(logits.reshape(-1, V), target[s].reshape(-1),
                                                       ignore_index=-100, reduction="sum") / counted
            if s.stop is None:                                   # the batch: HF's own loss, to float32
                torch.testing.assert_close(tokens, out.loss.double(), rtol=1e-6, atol=0)
            return tokens * (n if s.stop is not None else 1)
    _, got, want = against_per_example(model, loss_of, n, rtol=1e-8, atol=1e-24, fused=fused, complete=True)
    assert sum(want.values()).isfinite().all()


def test_conv1d_has_the_linear_rule_without_the_integration_imported():
    """GPT-2's Conv1D takes the Linear rule, registered by name (gns.layers.linear), in a process that never
    imports elasticlab.integrations; elasticlab itself does not import transformers for it (before: the
    generic rule, which forms B per-example gradients of each projection, unless the callback's module had
    been imported)."""
    import subprocess
    import sys
    code = (
        "import sys, torch, elasticlab.gns\n"
        "from elasticlab.gns import rule_for\n"
        "from elasticlab.gns.layers.linear import linear_norms\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers.pytorch_utils import Conv1D\n"
        "rule = rule_for(Conv1D(8, 4))\n"
        "assert rule.norms is linear_norms and rule.folds, rule\n"
        "assert not any(m.startswith('elasticlab.integrations') for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def assert_compiled_steps(model, loss, ref, eager_first: bool = False, stance: bool = True) -> None:
    """``loss(m)`` (the batch's loss through ``m``) backpropagated in two steps of ``torch.compile(model)``
    (aot_eager) inside PerSampleGradNorms, after one step of ``model`` itself with ``eager_first``: each
    step's norms equal ``ref`` (HF's losses are float32 even for a float64 model: rtol 1e-6). ``stance``:
    PerSampleGradNorms' own ``eager_first`` (off: compiled from the first step)."""
    import torch._dynamo
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, eager_first=stance) as norms:
        for m in (model,) * eager_first + (compiled, compiled):
            model.zero_grad()
            loss(m).backward()
            torch.testing.assert_close(norms.sq_norms(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_compiled_tiny_gpt2_per_example_norms(tied):
    """torch.compile (aot_eager) over GPT-2 inside PerSampleGradNorms: its Conv1D projections on the Linear
    rule, the tied table's hooks eager (a graph break at the embedding and the head), two steps equal to one
    backward per example (before: an error naming the tie; untied, a graph break at every Conv1D)."""
    model = tiny_gpt2(tied=tied).double()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    ref = sum(example_param_sq_norms(model, (loss_of(model, ids[i:i + 1]) for i in range(B))).values())
    assert_compiled_steps(model, lambda m: loss_of(m, ids), ref)


def test_compiled_tiny_beit_relative_position_bias():
    """BEiT's layer (its layer-scale parameters: an eager parent under torch.compile) passes the relative
    position bias its child returned, still followed, to its attention: that child runs eagerly (before:
    Dynamo traced the followed tensor into a RecursionError); the norms are one backward per example's."""
    torch.manual_seed(0)
    model = transformers.BeitForImageClassification(transformers.BeitConfig(
        image_size=32, patch_size=8, num_labels=2, use_relative_position_bias=True, drop_path_rate=0.0,
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 1])
    ref = sum(example_param_sq_norms(model, (model(pixel_values=x[b:b + 1], labels=y[b:b + 1]).loss
                                             for b in range(3))).values())
    assert_compiled_steps(model, lambda m: m(pixel_values=x, labels=y).loss, ref)


def _tiny(kind: str):
    """Tiny BERT (a (1, T) position embedding added in place), OPT (its MLP on (B·T, D) rows) and ALBERT
    (one layer shared across depth), for sequence classification, no dropout."""
    torch.manual_seed(0)
    common = dict(vocab_size=V, num_labels=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=T + 2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if kind == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(num_hidden_layers=2,
                                                                                  **common))
    if kind == "albert":
        return transformers.AlbertForSequenceClassification(transformers.AlbertConfig(
            num_hidden_layers=2, embedding_size=8, classifier_dropout_prob=0.0, **common))
    return transformers.OPTForSequenceClassification(transformers.OPTConfig(
        vocab_size=V, num_labels=2, hidden_size=16, num_attention_heads=2, ffn_dim=32, num_hidden_layers=2,
        max_position_embeddings=T + 2, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
        pad_token_id=1))


@pytest.mark.parametrize("kind", ["bert", "opt", "albert"])
def test_compiled_after_an_eager_step_matches_per_example_backward(kind):
    """torch.compile (aot_eager) over BERT, OPT and ALBERT as users call them (no position_ids): one eager
    step first, from which the positional embedding's broadcast, OPT's folded rows and ALBERT's shared
    layer are learned; the two compiled steps after it equal one backward per example (before: each was
    refused by name at every compiled step)."""
    model = _tiny(kind).double()
    ids = torch.randint(2, V, (3, T), generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0, 1, 1])
    ref = sum(example_param_sq_norms(model, (model(input_ids=ids[b:b + 1], labels=y[b:b + 1]).loss
                                             for b in range(3))).values())
    assert_compiled_steps(model, lambda m: m(input_ids=ids, labels=y).loss, ref, eager_first=True)


def test_compiled_bart_after_an_eager_step_matches_per_example_backward():
    """BART's decoder positional embedding has a forward of its own (positions made from ``position_ids`` by
    keyword, an offset added) and gives (1, T, D): after one eager step, which saw it only added to the
    batch, the compiled steps expand its output and take the vjp of its one forward at each example's
    gradient (layers.expand_plan); two compiled steps equal one backward per example (before: refused by
    name at every compiled step, eager step or not)."""
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, max_position_embeddings=T + 2, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)).double()
    ids = torch.randint(3, V, (3, T), generator=torch.Generator().manual_seed(6))
    ref = sum(example_param_sq_norms(model, (model(input_ids=ids[b:b + 1], labels=ids[b:b + 1]).loss
                                             for b in range(3))).values())
    assert_compiled_steps(model, lambda m: m(input_ids=ids, labels=ids).loss, ref, eager_first=True)


def test_compiled_swin_after_an_eager_step_matches_per_example_backward():
    """Swin's relative position bias (1, H, N, N) meets the batch on its windows' B·nW rows, shifted or not
    (the second stage: one window, the batch itself): after one eager step, which learned those rows'
    layout, the compiled steps repeat its output to each example's rows (layers.expand_plan); two compiled
    steps equal one backward per example (before: refused by name at every compiled step)."""
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[2, 1], num_heads=[1, 2], window_size=4,
        num_labels=2, drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 1])
    ref = sum(example_param_sq_norms(model, (model(pixel_values=x[b:b + 1], labels=y[b:b + 1]).loss
                                             for b in range(3))).values())
    assert_compiled_steps(model, lambda m: m(pixel_values=x, labels=y).loss, ref, eager_first=True)


@pytest.mark.parametrize("eager_first, stance", [(True, True), (False, False)])
def test_compiled_t5_relative_position_bias_matches_per_example_backward(eager_first, stance):
    """T5's relative position bias under torch.compile: its attention's ``compute_bias`` runs eagerly and
    looks the buckets up over the batch, in the layout the method gives its lookup (layers.bias_method);
    two compiled steps, after an eager one or compiled from the first (``eager_first=False``), equal one
    backward per example (before: refused by name, "ran without the batch ... under torch.compile")."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
        relative_attention_num_buckets=8, decoder_start_token_id=0)).double()
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(3))
    ref = sum(example_param_sq_norms(model, (model(input_ids=ids[b:b + 1], labels=ids[b:b + 1]).loss
                                             for b in range(3))).values())
    assert_compiled_steps(model, lambda m: m(input_ids=ids, labels=ids).loss, ref, eager_first, stance)


def test_compiled_t5_over_changing_lengths_compiles_no_more_than_plain():
    """T5 compiled (aot_eager) over batches of changing lengths, as with padding to each batch's longest:
    after the second length Dynamo marks the length dynamic and, as for the plain model, compiles nothing
    more; the relative position bias is traced on the symbolic lengths (layers.bias_method: its index taken
    from the method itself, no guard on the lengths) and every step's norms equal one backward per example
    (before: the bias method's lookup of the learned lengths guarded each length, a recompilation per
    length until Dynamo's limit, after which the stack ran eagerly)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
        relative_attention_num_buckets=8, decoder_start_token_id=0)).double()
    compiled = torch.compile(model, backend="aot_eager")
    gen, graphs = torch.Generator().manual_seed(3), []
    with PerSampleGradNorms(model) as norms:
        for t in (6, 8, 10, 12):
            ids = torch.randint(0, V, (3, t), generator=gen)
            ref = sum(example_param_sq_norms(model, (model(input_ids=ids[b:b + 1], labels=ids[b:b + 1]).loss
                                                     for b in range(3))).values())
            model.zero_grad()
            compiled(input_ids=ids, labels=ids).loss.backward()
            torch.testing.assert_close(norms.sq_norms(), ref, rtol=1e-6, atol=0)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[3] == graphs[2] == graphs[1], graphs


def test_compiled_t5_with_gradient_checkpointing():
    """T5 under torch.compile with (non-reentrant) gradient checkpointing of its blocks: the bias looked up
    over the batch at ``compute_bias`` (layers.bias_method), eager step and compiled steps alike, equals one
    backward per example (before: the eager step's followed bias reached a compiled frame, a RecursionError
    inside TorchDynamo)."""
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
        relative_attention_num_buckets=8, decoder_start_token_id=0, use_cache=False)).double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(3))
    ref = sum(example_param_sq_norms(model, (model(input_ids=ids[b:b + 1], labels=ids[b:b + 1]).loss
                                             for b in range(3))).values())
    assert_compiled_steps(model, lambda m: m(input_ids=ids, labels=ids).loss, ref, eager_first=True)
