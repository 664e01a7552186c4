"""Which Hugging Face architectures PerSampleGradNorms measures exactly: a coverage survey, not a timing.

Each case builds a tiny model of one architecture from its config (nothing downloaded; dropout off), in
float64, and compares ``sq_norms()`` of one step (the model's own loss, or a summed output norm) with one
backward per example (:func:`elasticlab.gns.reference.example_param_sq_norms`), to rtol 1e-6. Printed per
case: ``OK``, ``MISMATCH`` (with the per-example ratios) or the error's first line, which names what is not
covered. Needs ``transformers`` (``pip install 'elasticlab[integrations]'``).

    python benchmarks/hf_coverage.py [--only bart,t5,...] [--seq 10] [--pad right|left]

``--seq 3`` gives the token models as many positions as examples (B = 3): layouts that only the graph
tells apart ((B, T, D) folded to (B·T, D) against (T, B, D)).

``--pad right|left`` pads the token batch as a collator does: the examples keep ``seq``, about 2/3 and
about 1/3 of their tokens, the rest are pad tokens with ``attention_mask`` 0 and label -100. The language
models' loss is then a mean over the batch's counted tokens, not over examples, so the reference is each
example's gradient of that batch loss: its own loss times ``B · counted_b / counted`` (counted: labels that
are not -100, after the shift for decoder-only models), one backward per example at the same padding.

``--compile aot_eager|inductor`` measures ``torch.compile(model, backend=...)`` inside PerSampleGradNorms
as a user runs it: three steps through the compiled model, the first of them eager (PerSampleGradNorms'
``eager_first``: it learns there what it cannot read in a traced forward, a batch-less positional
embedding's use, a module called several times, the layout of rows that fold the batch), each against the
float64 reference as above (graph breaks allowed, a crash reported). ``--compile-first``: with
``eager_first=False``, two steps compiled from the first; ``--eager-first``: one step of the model itself
(eager) before two compiled ones.

``--last-batch N`` (with ``--compile``, unpadded) adds a compiled step on the first N examples: an epoch's
last, smaller batch, at which nothing was learned eagerly.

``--autocast bf16|fp16`` runs the float32 model under ``torch.autocast("cpu")`` in that dtype (fp16 with a
``torch.amp.GradScaler``'s loss scale, 2^16, handed to PerSampleGradNorms) and compares with the float64
reference: ``OK`` when every parameter's median relative error over the examples is
under 2% (issue 14's bound for bf16), the worst such parameter printed. Beside it, that parameter's error
in one backward per example run alone under the same autocast (how far the 16-bit forward moves the
gradients by itself), its distance from one backward per example through the batch's own 16-bit forward
(each example's share of the batch loss: the norms' own error, with the batch's rounding and routing),
and the worst error of the whole-model norm per example. Parameters whose
reference is zero but for rounding (an attention's key bias) are left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from tqdm import tqdm

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.reference import example_param_sq_norms

B, T, V = 3, 10, 50
D = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


PAD = 0  # the pad token: the ids are drawn from 1..V-1


def _data(seq: int = T, pad: str | None = None):
    """The batch; with ``pad`` ("right" or "left") the token examples are padded to ``seq`` and
    ``mask`` (attention mask) and ``lm_labels`` (-100 at the pads) are given."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (B, seq), generator=g)
    d = {
        "ids": ids,
        "lm_labels": ids,
        "img": torch.randn(B, 3, 32, 32, dtype=torch.float64, generator=g),
        "audio": torch.randn(B, 400, dtype=torch.float64, generator=g),
        "mel": torch.randn(B, 8, 32, dtype=torch.float64, generator=g),
        "labels": torch.tensor([0, 1, 1]),
    }
    if pad is not None:
        lens = [seq, max(1, (2 * seq + 2) // 3), max(1, (seq + 2) // 3)]
        keep = torch.arange(seq).expand(B, -1) < torch.tensor(lens)[:, None]
        keep = keep if pad == "right" else keep.flip(1)
        d["ids"] = ids.masked_fill(~keep, PAD)
        d["lm_labels"] = ids.masked_fill(~keep, -100)
        d["mask"] = keep.long()
    return d


def _tokens(d: dict, i) -> dict:
    """input_ids, with the attention mask when the batch is padded."""
    return {"input_ids": d["ids"][i], **({"attention_mask": d["mask"][i]} if "mask" in d else {})}


def _share(d: dict, b: int) -> dict:
    """The batch with only example b's labels (the others -100) and ``keep``: its loss through the whole
    batch's forward is example b's share of the batch loss."""
    keep = torch.arange(B) == b
    out = dict(d, keep=keep, labels=d["labels"].masked_fill(~keep, -100))
    out["lm_labels"] = d["lm_labels"].masked_fill(~keep[:, None], -100)
    return out


def _sq_sum(x: torch.Tensor, d: dict, i) -> torch.Tensor:
    """Σ x² over the examples the data keeps (all of them unless ``_share`` chose one)."""
    return (x if "keep" not in d else x[d["keep"][i]]).pow(2).sum()


def _counted(shifted: bool):
    """(d, b) -> the labels of example b that the batch's mean token loss counts."""
    return lambda d, b: int((d["lm_labels"][b, 1:] if shifted else d["lm_labels"][b]).ne(-100).sum())


def _eager_experts(model):
    """The experts as a loop of F.linear per expert (grouped_mm takes no float64 on the CPU)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


def cases(tr) -> dict:
    """{name: () -> (model, loss(model, data, index), reduction, counted)}; the losses are means over the
    batch (reduction "mean") unless said; ``counted(data, b)`` is the tokens of example b in a mean over
    the batch's tokens (language models), None where the loss is per example."""
    lm_loss = lambda m, d, i: m(**_tokens(d, i), labels=d["lm_labels"][i]).loss  # noqa: E731
    lm = (lm_loss, "mean", _counted(shifted=True))
    s2s_lm = (lm_loss, "mean", _counted(shifted=False))
    cls = (lambda m, d, i: m(**_tokens(d, i), labels=d["labels"][i]).loss, "mean", None)
    img = (lambda m, d, i: m(pixel_values=d["img"][i], labels=d["labels"][i]).loss, "mean", None)
    pooled_img = (lambda m, d, i: _sq_sum(m(pixel_values=d["img"][i]).pooler_output, d, i), "sum", None)
    pooled_txt = (lambda m, d, i: _sq_sum(m(**_tokens(d, i)).pooler_output, d, i), "sum", None)
    s2s = dict(
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        dropout=0.0,
    )
    t5 = dict(
        vocab_size=V,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    )
    kv = dict(num_key_value_heads=1, max_position_embeddings=32)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    audio = dict(  # wav2vec 2.0's feature encoder and positional convolution, small; dropout off
        vocab_size=V,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        num_labels=2,
        **D,
    )
    return {
        "gpt2": lambda: (
            tr.GPT2LMHeadModel(
                tr.GPT2Config(
                    vocab_size=V,
                    n_embd=16,
                    n_layer=2,
                    n_head=2,
                    n_positions=32,
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attn_pdrop=0.0,
                )
            ),
            *lm,
        ),
        "gpt_neo": lambda: (
            tr.GPTNeoForCausalLM(
                tr.GPTNeoConfig(
                    vocab_size=V,
                    hidden_size=16,
                    num_layers=2,
                    num_heads=2,
                    attention_types=[[["global", "local"], 1]],
                    max_position_embeddings=32,
                    embed_dropout=0.0,
                    attention_dropout=0.0,
                    resid_dropout=0.0,
                )
            ),
            *lm,
        ),
        "gpt_neox": lambda: (
            tr.GPTNeoXForCausalLM(
                tr.GPTNeoXConfig(
                    vocab_size=V, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, **D
                )
            ),
            *lm,
        ),
        "opt": lambda: (
            tr.OPTForCausalLM(
                tr.OPTConfig(
                    vocab_size=V,
                    hidden_size=16,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    ffn_dim=32,
                    max_position_embeddings=32,
                    dropout=0.0,
                    word_embed_proj_dim=16,
                )
            ),
            *lm,
        ),
        "bloom": lambda: (
            tr.BloomForCausalLM(
                tr.BloomConfig(
                    vocab_size=V,
                    hidden_size=16,
                    n_layer=2,
                    n_head=2,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                )
            ),
            *lm,
        ),
        "falcon": lambda: (
            tr.FalconForCausalLM(
                tr.FalconConfig(
                    vocab_size=V,
                    hidden_size=16,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                )
            ),
            *lm,
        ),
        "llama": lambda: (tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=V, **kv, **D)), *lm),
        "mistral": lambda: (tr.MistralForCausalLM(tr.MistralConfig(vocab_size=V, **kv, **D)), *lm),
        "qwen2": lambda: (tr.Qwen2ForCausalLM(tr.Qwen2Config(vocab_size=V, **kv, **D)), *lm),
        "gemma": lambda: (tr.GemmaForCausalLM(tr.GemmaConfig(vocab_size=V, head_dim=8, **kv, **D)), *lm),
        "mixtral": lambda: (
            _eager_experts(
                tr.MixtralForCausalLM(
                    tr.MixtralConfig(vocab_size=V, num_local_experts=4, num_experts_per_tok=2, **kv, **D)
                )
            ),
            *lm,
        ),
        "qwen2_moe": lambda: (
            _eager_experts(
                tr.Qwen2MoeForCausalLM(
                    tr.Qwen2MoeConfig(vocab_size=V, shared_expert_intermediate_size=8, decoder_sparse_step=1,
                                      **moe, **kv, **D)
                )
            ),
            *lm,
        ),
        "olmoe": lambda: (
            _eager_experts(
                tr.OlmoeForCausalLM(
                    tr.OlmoeConfig(vocab_size=V, num_experts=4, num_experts_per_tok=2, **kv, **D)
                )
            ),
            *lm,
        ),
        "deepseek_v3": lambda: (
            _eager_experts(
                tr.DeepseekV3ForCausalLM(
                    tr.DeepseekV3Config(vocab_size=V, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                        topk_group=1, first_k_dense_replace=0, moe_intermediate_size=8,
                                        q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                                        qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=32,
                                        num_key_value_heads=2, **D)
                )
            ),
            *lm,
        ),
        "gpt_oss": lambda: (
            _eager_experts(
                tr.GptOssForCausalLM(
                    tr.GptOssConfig(vocab_size=V, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                    sliding_window=8, **kv, **D)
                )
            ),
            *lm,
        ),
        "phi": lambda: (
            tr.PhiForCausalLM(
                tr.PhiConfig(
                    vocab_size=V,
                    max_position_embeddings=32,
                    resid_pdrop=0.0,
                    embd_pdrop=0.0,
                    attention_dropout=0.0,
                    **D,
                )
            ),
            *lm,
        ),
        "mamba": lambda: (
            tr.MambaForCausalLM(
                tr.MambaConfig(
                    vocab_size=V,
                    hidden_size=16,
                    state_size=4,
                    num_hidden_layers=2,
                    expand=2,
                    conv_kernel=2,
                    use_cache=False,
                )
            ),
            *lm,
        ),
        "mamba2": lambda: (
            tr.Mamba2ForCausalLM(
                tr.Mamba2Config(
                    vocab_size=V,
                    hidden_size=16,
                    num_hidden_layers=2,
                    num_heads=4,
                    head_dim=8,
                    state_size=8,
                    n_groups=1,
                    expand=2,
                    chunk_size=4,
                )
            ),
            *lm,
        ),
        "rwkv": lambda: (
            tr.RwkvForCausalLM(
                tr.RwkvConfig(
                    vocab_size=V,
                    hidden_size=16,
                    num_hidden_layers=2,
                    attention_hidden_size=16,
                    intermediate_size=32,
                    context_length=32,
                )
            ),
            *lm,
        ),
        "bert": lambda: (
            tr.BertForSequenceClassification(
                tr.BertConfig(vocab_size=V, max_position_embeddings=32, **NO_DROP, **D)
            ),
            *cls,
        ),
        "albert": lambda: (
            tr.AlbertForSequenceClassification(
                tr.AlbertConfig(
                    vocab_size=V,
                    embedding_size=8,
                    max_position_embeddings=32,
                    classifier_dropout_prob=0.0,
                    **NO_DROP,
                    **D,
                )
            ),
            *cls,
        ),
        "funnel": lambda: (
            tr.FunnelForSequenceClassification(
                tr.FunnelConfig(
                    vocab_size=V,
                    block_sizes=[1, 1],
                    d_model=16,
                    n_head=2,
                    d_head=8,
                    d_inner=32,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    activation_dropout=0.0,
                )
            ),
            *cls,
        ),
        "roberta": lambda: (
            tr.RobertaForSequenceClassification(
                tr.RobertaConfig(vocab_size=V, max_position_embeddings=40, **NO_DROP, **D)
            ),
            *cls,
        ),
        "distilbert": lambda: (
            tr.DistilBertForSequenceClassification(
                tr.DistilBertConfig(
                    vocab_size=V,
                    dim=16,
                    n_layers=2,
                    n_heads=2,
                    hidden_dim=32,
                    max_position_embeddings=32,
                    dropout=0.0,
                    attention_dropout=0.0,
                    seq_classif_dropout=0.0,
                )
            ),
            *cls,
        ),
        "electra": lambda: (
            tr.ElectraForSequenceClassification(
                tr.ElectraConfig(vocab_size=V, embedding_size=16, max_position_embeddings=32, **NO_DROP, **D)
            ),
            *cls,
        ),
        "deberta_v2": lambda: (
            tr.DebertaV2ForSequenceClassification(
                tr.DebertaV2Config(vocab_size=V, max_position_embeddings=32, **NO_DROP, **D)
            ),
            *cls,
        ),
        "modernbert": lambda: (
            tr.ModernBertForSequenceClassification(
                tr.ModernBertConfig(vocab_size=V, max_position_embeddings=32, pad_token_id=0, **D)
            ),
            *cls,
        ),
        "bart": lambda: (
            tr.BartForConditionalGeneration(
                tr.BartConfig(
                    vocab_size=V,
                    max_position_embeddings=32,
                    attention_dropout=0.0,
                    activation_dropout=0.0,
                    **s2s,
                )
            ),
            *s2s_lm,
        ),
        "t5": lambda: (tr.T5ForConditionalGeneration(tr.T5Config(**t5)), *s2s_lm),
        "flan_t5": lambda: (
            tr.T5ForConditionalGeneration(
                tr.T5Config(**t5, tie_word_embeddings=False, feed_forward_proj="gated-gelu")
            ),
            *s2s_lm,
        ),
        "umt5": lambda: (tr.UMT5ForConditionalGeneration(tr.UMT5Config(**t5)), *s2s_lm),
        "longt5": lambda: (tr.LongT5ForConditionalGeneration(tr.LongT5Config(**t5, local_radius=4)),
                           *s2s_lm),
        "whisper": lambda: (
            tr.WhisperForConditionalGeneration(
                tr.WhisperConfig(
                    vocab_size=V,
                    num_mel_bins=8,
                    max_source_positions=16,
                    max_target_positions=32,
                    decoder_start_token_id=0,
                    pad_token_id=0,
                    **s2s,
                )
            ),
            lambda m, d, i: m(input_features=d["mel"][i], labels=d["lm_labels"][i]).loss,
            "mean",
            _counted(shifted=False),
        ),
        "wav2vec2": lambda: (
            tr.Wav2Vec2ForSequenceClassification(
                tr.Wav2Vec2Config(**audio)
            ),
            lambda m, d, i: m(input_values=d["audio"][i], labels=d["labels"][i]).loss,
            "mean",
            None,
        ),
        "wavlm": lambda: (
            tr.WavLMForSequenceClassification(
                tr.WavLMConfig(num_buckets=8, max_bucket_distance=16, **audio)
            ),
            lambda m, d, i: m(input_values=d["audio"][i], labels=d["labels"][i]).loss,
            "mean",
            None,
        ),
        "vit": lambda: (
            tr.ViTForImageClassification(
                tr.ViTConfig(image_size=32, patch_size=8, num_labels=2, **NO_DROP, **D)
            ),
            *img,
        ),
        "deit": lambda: (
            tr.DeiTForImageClassification(
                tr.DeiTConfig(image_size=32, patch_size=8, num_labels=2, **NO_DROP, **D)
            ),
            *img,
        ),
        "beit": lambda: (
            tr.BeitForImageClassification(
                tr.BeitConfig(
                    image_size=32,
                    patch_size=8,
                    num_labels=2,
                    use_relative_position_bias=True,
                    drop_path_rate=0.0,
                    **NO_DROP,
                    **D,
                )
            ),
            *img,
        ),
        "dinov2": lambda: (
            tr.Dinov2ForImageClassification(
                tr.Dinov2Config(image_size=32, patch_size=8, num_labels=2, **NO_DROP, **D)
            ),
            *img,
        ),
        "swin": lambda: (
            tr.SwinForImageClassification(
                tr.SwinConfig(
                    image_size=32,
                    patch_size=4,
                    embed_dim=8,
                    depths=[1, 1],
                    num_heads=[1, 2],
                    window_size=4,
                    num_labels=2,
                    drop_path_rate=0.0,
                    **NO_DROP,
                )
            ),
            *img,
        ),
        "clip_vision": lambda: (
            tr.CLIPVisionModel(tr.CLIPVisionConfig(image_size=32, patch_size=8, **D)),
            *pooled_img,
        ),
        "clip_text": lambda: (
            tr.CLIPTextModel(tr.CLIPTextConfig(vocab_size=V, max_position_embeddings=32, **D)),
            *pooled_txt,
        ),
        "siglip_vision": lambda: (
            tr.SiglipVisionModel(tr.SiglipVisionConfig(image_size=32, patch_size=8, **D)),
            *pooled_img,
        ),
    }


def _weights(data: dict, counted) -> list[float]:
    """Each example's reference loss weight: B · counted_b / counted for a mean over the batch's tokens
    (``counted``), else 1."""
    if counted is None:
        return [1.0] * B
    n = [counted(data, b) for b in range(B)]
    return [B * n_b / sum(n) for n_b in n]


def check(model, loss, reduction: str, data: dict, counted=None) -> str:
    """``OK``, ``MISMATCH [ratios]``, ``REFERENCE non-finite`` (the model's own one-example backward) or
    ``ERROR <type>: <message>`` for one model. With ``counted`` (a mean over the batch's tokens) each
    example's reference loss is weighted by ``B · counted_b / counted``: its share of the batch loss."""
    model = model.double().train()
    weight = _weights(data, counted)
    try:
        want = sum(example_param_sq_norms(
            model, (loss(model, data, slice(b, b + 1)) * weight[b] for b in range(B))).values())
        if not want.isfinite().all():
            return f"REFERENCE non-finite {want.tolist()} (one backward per example, without elasticlab)"
        with PerSampleGradNorms(model, loss_reduction=reduction) as psn:
            model.zero_grad()
            loss(model, data, slice(None)).backward()
            got = psn.sq_norms()
    except Exception as e:  # noqa: BLE001  (the survey reports whatever stops a model)
        return f"ERROR {type(e).__name__}: {str(e).splitlines()[0]}"
    if torch.allclose(got.double(), want, rtol=1e-6, atol=0):
        return "OK"
    return f"MISMATCH {[round(r, 6) for r in (got.double() / want).tolist()]}"


def _medians(got: dict, want: dict) -> dict:
    """{param: median over the examples of |got/want - 1|}, leaving out the parameters whose reference is
    zero but for rounding (an attention's key bias) or zero (not reached)."""
    scale = max((float(v.max()) for v in want.values() if v.isfinite().all()), default=0.0)
    return {k: float(((got[k].double() - w.double()).abs() / w.double().clamp_min(1e-300)).median())
            for k, w in want.items() if w.isfinite().all() and float(w.max()) >= 1e-12 * scale}


def check_compiled(model, loss, reduction: str, data: dict, counted, backend: str,
                   eager_first: bool = False, last: int | None = None, stance: bool = True) -> str:
    """``OK``, ``MISMATCH`` (the step and its ratios) or ``ERROR``: the compiled model's norms over its
    steps against one float64 backward per example of the eager model: three (``stance``: the first forced
    eager by PerSampleGradNorms' ``eager_first``), or two compiled from the first (not ``stance``); with
    ``eager_first``, two after one step of the model itself; with ``last``, then a compiled step on the
    batch's first ``last`` examples, an epoch's last, smaller batch (unpadded batches only: each example's
    reference is then its own loss)."""
    import torch._dynamo
    torch._dynamo.reset()
    model = model.double().train()
    weight = _weights(data, counted)
    try:
        want = sum(example_param_sq_norms(
            model, (loss(model, data, slice(b, b + 1)) * weight[b] for b in range(B))).values())
        compiled = torch.compile(model, backend=backend)
        compiled_steps = 2 + (stance and not eager_first)
        calls = ["model"] * eager_first + ["compiled"] * compiled_steps + ["last"] * bool(last)
        with PerSampleGradNorms(model, loss_reduction=reduction, eager_first=stance) as psn:
            for step, call in enumerate(calls):
                model.zero_grad()
                part = slice(0, last) if call == "last" else slice(None)
                loss(model if call == "model" else compiled, data, part).backward()
                got = psn.sq_norms()
                if not torch.allclose(got.double(), want[part], rtol=1e-6, atol=0):
                    return f"MISMATCH at step {step} {[round(r, 6) for r in (got.double() / want).tolist()]}"
    except Exception as e:  # noqa: BLE001  (the survey reports whatever stops a model)
        return f"ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "OK"


def _finite_step(model, batch_loss, dtype: torch.dtype, scale: float) -> bool:
    """Whether one plain step under autocast, its loss times ``scale``, leaves every gradient finite."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        out = batch_loss()
    (out.float() * scale).backward()
    finite = all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    model.zero_grad()
    return finite


def check_autocast(model, loss, reduction: str, data: dict, counted, dtype: torch.dtype) -> str:
    """``OK``, ``INEXACT`` or ``ERROR``: the float32 model's norms under CPU autocast in ``dtype`` against one
    float64 backward per example (the verdict, see the module's docstring), and against one backward per
    example under the same autocast (the norms' own error, apart from what the 16-bit forward changes)."""
    model = model.double().train()
    weight = _weights(data, counted)
    f32 = {k: v.float() if v.is_floating_point() else v for k, v in data.items()}

    # float16 as it is trained: the loss scaled, lest small gradients flush to zero in the 16-bit backward,
    # from GradScaler's initial 2^16, halved after each step whose gradients overflow (as the scaler backs
    # off; the step it would skip); the references' norms are unscaled by hand, ours by the scaler
    scaler, S, skipped = None, 1.0, 0
    if dtype == torch.float16:
        S = 2.0**16
        model.float()
        while not _finite_step(model, lambda: loss(model, f32, slice(None)), dtype, S) and S > 1:
            S, skipped = S / 2, skipped + 1
        scaler = torch.amp.GradScaler("cpu", init_scale=S)
        model.double()

    def losses(d, s=1.0):
        return (loss(model, d, slice(b, b + 1)).float() * (weight[b] * s) for b in range(B))

    def unscale(norms, s):
        return {k: v / s**2 for k, v in norms.items()}
    try:
        want = example_param_sq_norms(model, losses(data))
        model.float()
        with torch.autocast("cpu", dtype=dtype):
            alone = unscale(example_param_sq_norms(model, losses(f32, S)), S)
            # at the batch's own scale (1/B of each example's under "mean"), so that the 16-bit backward
            # rounds each share as it rounds the batch; the norms are scaled back
            div = B if reduction == "mean" else 1
            shares = unscale(example_param_sq_norms(
                model, (loss(model, _share(f32, b), slice(None)).float() * (weight[b] * S / div)
                        for b in range(B))), S / div)
        with PerSampleGradNorms(model, loss_reduction=reduction, grad_scaler=scaler) as psn:
            model.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                batch = loss(model, f32, slice(None))
            (scaler.scale(batch.float()) if scaler is not None else batch.float()).backward()
            got = psn.param_sq_norms()
    except Exception as e:  # noqa: BLE001  (the survey reports whatever stops a model)
        return f"ERROR {type(e).__name__}: {str(e).splitlines()[0]}"
    if not all(v.isfinite().all() for v in want.values()):
        return "REFERENCE non-finite (one backward per example, without elasticlab)"
    bad = sorted(k for k, v in got.items() if not v.isfinite().all())
    if bad:
        return f"NON-FINITE {bad[:3]} (an overflow the scaler would skip)"
    missing = sorted(k for k in set(want) - set(got) if float(want[k].max()) > 0)
    if missing:
        return f"MISSING {missing[:3]}"
    ours, model16, own = _medians(got, want), _medians(alone, want), _medians(got, shares)
    nan = float("nan")          # (a parameter one reference holds at zero but for rounding, the other not)
    worst = max(ours, key=ours.get)
    total = float(((sum(got.values()).double() / sum(want.values())) - 1).abs().max())
    verdict = "OK" if ours[worst] < 0.02 else "INEXACT"
    scaled = f"; loss scale 2^{int(torch.tensor(S).log2())} after {skipped} overflowed" * (scaler is not None)
    return (f"{verdict} {worst} median {100 * ours[worst]:.1f}% (each example alone under autocast: "
            f"{100 * model16.get(worst, nan):.1f}%; against the batch's own backward per example: "
            f"{100 * own.get(worst, nan):.2f}%, worst {100 * max(own.values(), default=nan):.2f}%); "
            f"whole-model norm {100 * total:.2f}% off at worst{scaled}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--seq", type=int, default=T, help=f"positions of the token models (default {T})")
    ap.add_argument("--pad", choices=("right", "left"), default=None,
                    help="pad the token examples to --seq (attention mask, labels -100 at the pads)")
    ap.add_argument("--compile", choices=("aot_eager", "inductor"), default=None,
                    help="the model under torch.compile with this backend, two steps")
    ap.add_argument("--eager-first", action="store_true",
                    help="with --compile: one eager step of the model before two compiled ones")
    ap.add_argument("--compile-first", action="store_true",
                    help="with --compile: eager_first=False, compiled from the first step")
    ap.add_argument("--last-batch", type=int, default=None,
                    help=f"with --compile: then a compiled step on this many of the {B} examples")
    ap.add_argument("--autocast", choices=("bf16", "fp16"), default=None,
                    help="the float32 model under CPU autocast in this dtype, against float64 (2%% medians)")
    args = ap.parse_args()
    if args.seq < 1:
        raise SystemExit(f"--seq must be at least 1, got {args.seq}")
    if (args.eager_first or args.compile_first) and not args.compile:
        raise SystemExit("--eager-first and --compile-first need --compile")
    if args.last_batch is not None and not (args.compile and not args.pad and 1 <= args.last_batch < B):
        raise SystemExit(f"--last-batch needs --compile, no --pad, and 1..{B - 1} examples, got "
                         f"{args.last_batch}")
    try:
        import transformers as tr
    except ImportError as e:
        raise SystemExit("transformers is not installed: pip install 'elasticlab[integrations]'") from e
    warnings.filterwarnings("ignore")
    tr.logging.set_verbosity_error()
    table = cases(tr)
    names = [n for n in args.only.split(",") if n] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(table)}")
    data, out = _data(args.seq, args.pad), {}
    for name in tqdm(names, desc="architectures"):
        torch.manual_seed(0)
        try:
            model, loss, reduction, counted = table[name]()
        except Exception as e:  # noqa: BLE001  (a config this transformers version rejects)
            out[name] = f"BUILD {type(e).__name__}: {str(e).splitlines()[0]}"
            continue
        if args.compile:
            out[name] = check_compiled(model, loss, reduction, data, counted, args.compile, args.eager_first,
                                       args.last_batch, not args.compile_first)
        elif args.autocast:
            dtype = torch.bfloat16 if args.autocast == "bf16" else torch.float16
            out[name] = check_autocast(model, loss, reduction, data, counted, dtype)
        else:
            out[name] = check(model, loss, reduction, data, counted)
    for name, verdict in out.items():
        print(f"{name:14s} {verdict[:300]}")
    ok = sum(v.startswith("OK") for v in out.values())
    how = (f", padded {args.pad}" if args.pad else "") + (f", {args.autocast} autocast" * bool(args.autocast))
    how += f", compiled ({args.compile})" * bool(args.compile) + ", after an eager step" * args.eager_first
    how += ", from the first step (eager_first=False)" * args.compile_first
    how += f", then a compiled batch of {args.last_batch}" * (args.last_batch is not None)
    verdict = "within 2%" if args.autocast else "exact"
    print(f"{ok} of {len(out)} {verdict}{how}; transformers {tr.__version__}, torch {torch.__version__}")
    print("RESULT " + json.dumps({"transformers": tr.__version__, "torch": torch.__version__, "pad": args.pad,
                                  "autocast": args.autocast, "compile": args.compile,
                                  "eager_first": args.eager_first, "last_batch": args.last_batch,
                                  "compile_first": args.compile_first,
                                  "cases": out}))


if __name__ == "__main__":
    main()
