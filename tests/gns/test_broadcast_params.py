"""Bare parameters broadcast over the batch by a module with children (gns.layers.broadcast_params): a ViT's
class token and position embedding, learned tokens expanded or repeated, a gain multiplying a child's output.
Each case against one backward per example in float64 (before: "no per-example gradient-norm rule for
module ... (parameters ['cls_token', 'pos_embed'])" under strict, left out with strict=False)."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from layer_check import against_per_example, assert_norms, eager_then_compiled
from torch import nn
from torch.utils.checkpoint import checkpoint

from elasticlab.gns import PerSampleGradNorms
from elasticlab.gns.layers import broadcast_params
from elasticlab.gns.reference import example_param_sq_norms


class ViT(nn.Module):
    """A ViT's embedding (Dosovitskiy et al. 2021, eq. 1) as timm writes it, its position embedding used a
    second time through a slice (a tensor made from it, mapped back by a batched vjp), and a mean pool."""

    def __init__(self, D=8, N=4, P=6, classes=3):
        super().__init__()
        self.patch = nn.Linear(P, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, N + 1, D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, classes)

    def forward(self, x):
        x = self.patch(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        x = torch.tanh(x) + self.pos_embed[:, :1] * 0.5
        return self.head(self.norm(x).mean(1))


def per_example(model, fwd, x, y):
    """‖∇θ ℓ_b‖² by one backward per example (what the norms are, for a summed or a mean-reduced loss)."""
    return example_param_sq_norms(model, (F.cross_entropy(fwd(x[b:b + 1]), y[b:b + 1], reduction="sum")
                                          for b in range(x.shape[0])))


def check(model, x, y, fused=True, reduction="sum", steps=2, fwd=None, strict=True, ref=None):
    """``ref``: the forward of the reference (the model's own by default)."""
    fwd = fwd or model
    want = per_example(model, ref or fwd, x, y)
    with PerSampleGradNorms(model, loss_reduction=reduction, fused=fused, strict=strict) as psn:
        for _ in range(steps):
            model.zero_grad()
            F.cross_entropy(fwd(x), y, reduction=reduction).backward()
            assert_norms(psn.param_sq_norms(), want, rtol=1e-9)
            torch.testing.assert_close(psn.sq_norms(), sum(want.values()), rtol=1e-9, atol=1e-12)
    return psn


def data(B=5, N=4, P=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, N, P, generator=g, dtype=torch.float64),
            torch.randint(0, classes, (B,), generator=g))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_vit_class_token_and_position_embedding(fused, reduction):
    torch.manual_seed(0)
    model = ViT().double()
    check(model, *data(), fused=fused, reduction=reduction)
    assert isinstance(model.cls_token, nn.Parameter)            # given back after each forward


class Uses(nn.Module):
    """A child Linear and a bare parameter ``p`` of ``shape`` entering the batch by ``use(x, p)``."""

    def __init__(self, shape, use, D=8):
        super().__init__()
        self.lin = nn.Linear(6, D)
        self.p = nn.Parameter(torch.randn(shape))
        self.use = use

    def forward(self, x):
        return self.use(self.lin(x), self.p).mean(1)[:, :3]


USES = {
    "add 3-d": ((1, 4, 8), lambda h, p: h + p),
    "add 2-d": ((4, 8), lambda h, p: p + h),
    "mul gain": ((8,), lambda h, p: h * p),                      # a LayerScale written in the parent
    "div": ((1, 1, 8), lambda h, p: h / (2 + p * p)),
    "in-place add": ((1, 4, 8), lambda h, p: h.clone().add_(p)),
    "torch.where": ((4, 8), lambda h, p: torch.where(h > 0, h, p)),
    "expand then cat": ((1, 1, 8), lambda h, p: torch.cat([p.expand(h.shape[0], -1, -1), h], 1)),
    "repeat": ((1, 2, 8), lambda h, p: torch.cat([p.repeat(h.shape[0], 1, 1), h], 1)),
    "repeat of a 2-d one": ((2, 8), lambda h, p: torch.cat([p.repeat(h.shape[0], 1, 1), h], 1)),
    "tile along tokens": ((1, 1, 8), lambda h, p: torch.cat([p.tile(h.shape[0], 3, 1), h], 1)),
    "broadcast_to": ((1, 1, 8), lambda h, p: torch.cat([torch.broadcast_to(p, (h.shape[0], 1, 8)), h], 1)),
    "expand_as": ((1, 4, 8), lambda h, p: p.expand_as(h) * h),
    "unsqueeze then expand": ((3, 8), lambda h, p: torch.cat([p[None].expand(h.shape[0], 3, 8), h], 1)),
    "interpolated": ((1, 8, 2), lambda h, p: h + F.interpolate(p, size=4, mode="linear").transpose(1, 2)),
    "used twice": ((1, 4, 8), lambda h, p: torch.tanh(h + p) * p[:, :1].exp()),
}


@settings(max_examples=30, deadline=None)
@given(use=st.sampled_from(sorted(USES)), B=st.integers(1, 6), fused=st.booleans(), seed=st.integers(0, 99))
def test_each_way_of_broadcasting_a_bare_parameter(use, B, fused, seed):
    shape, fn = USES[use]
    torch.manual_seed(seed)
    model = Uses(shape, fn).double()
    check(model, *data(B=B, seed=seed), fused=fused, steps=1)


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.vit = ViT()

    def forward(self, x):
        return self.vit(x) + self.vit(x.flip(1) * 0.5)


def test_a_module_called_twice_sums_its_calls():
    """A siamese forward calling the ViT on two views: its bare parameters' per-example gradients add up
    over the calls (the Linears inside run on hooks from the first step, fused: NaN there)."""
    torch.manual_seed(0)
    model = Siamese().double()
    check(model, *data(), fused=False)


class MatmulUse(nn.Module):
    """A bare weight used by a tensordot with the batch: not a broadcast, nor a layer's op that is taken per
    example (``matmul``, ``einsum``: :func:`test_a_bare_weight_of_a_matmul_is_taken_per_example`)."""

    def __init__(self, op="tensordot"):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.w = nn.Parameter(torch.randn(8, 3))
        self.op = op

    def forward(self, x):
        h = self.lin(x)
        out = {"tensordot": lambda: torch.tensordot(h, self.w, dims=1), "matmul": lambda: h @ self.w,
               "einsum": lambda: torch.einsum("btd,de->bte", h, self.w)}[self.op]()
        return out.mean(1)


@pytest.mark.parametrize("op", ["matmul", "einsum"])
@pytest.mark.parametrize("fused", [True, False])
def test_a_bare_weight_of_a_matmul_is_taken_per_example(fused, op):
    """``h @ w`` or ``einsum("btd,de->bte", h, w)`` with h's dim 0 the batch: each example's gradient of w is
    the vjp of the op on its rows (Step.through)."""
    torch.manual_seed(0)
    check(MatmulUse(op).double(), *data(), fused=fused)


def test_a_use_that_is_not_a_broadcast_is_named_or_left_out():
    torch.manual_seed(0)
    model = MatmulUse().double()
    x, y = data()
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        with pytest.raises(RuntimeError, match=r"bare parameter 'w' of module '\(root\)' \(MatmulUse\) is "
                                               r"used by .*tensordot.* not as a broadcast over the batch"):
            psn.sq_norms()
    want = per_example(model, model, x, y)
    with PerSampleGradNorms(model, loss_reduction="sum", strict=False) as psn:
        model.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = psn.param_sq_norms()
            g2 = psn.grad_sq_norm()
        assert sorted(got) == ["lin.bias", "lin.weight"] and any("left out" in str(m.message) for m in w)
        assert psn.left_out == ["w"] and psn.skipped == []
        torch.testing.assert_close(got["lin.weight"], want["lin.weight"], rtol=1e-9, atol=1e-12)
        lin = model.lin.weight.grad.pow(2).sum() + model.lin.bias.grad.pow(2).sum()
        assert g2 == pytest.approx(float(lin) / x.shape[0] ** 2)          # (a summed loss: ḡ = Σ / B)


def test_switched_off_bare_parameters_are_uncovered_again(monkeypatch):
    monkeypatch.setattr(broadcast_params, "ENABLED", False)
    with pytest.raises(ValueError, match=r"module '\(root\)' of type ViT \(parameters \['cls_token', 'pos_"):
        PerSampleGradNorms(ViT())
    assert PerSampleGradNorms(ViT(), strict=False).skipped == ["cls_token", "pos_embed"]


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.vit, self.reentrant = ViT(), reentrant

    def forward(self, x):
        return checkpoint(self.vit, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_activation_checkpointing(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant).double()
    x, y = data()
    # the reference without checkpointing (a reentrant checkpoint does not support torch.autograd.grad)
    check(model, x.requires_grad_(reentrant), y, fused=False, ref=model.vit)


def test_bf16_autocast_near_fp32():
    torch.manual_seed(0)
    model = ViT(D=32, N=16, P=12)
    x = torch.randn(8, 16, 12)
    out = {}
    for ac in (False, True):
        with PerSampleGradNorms(model) as psn, torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
            got = psn.param_sq_norms()
            out[ac] = torch.stack([got["cls_token"], got["pos_embed"]])
    assert out[True].dtype == torch.float32
    assert ((out[True] - out[False]).abs() / out[False]).median() < 0.02


class Embed(nn.Module):
    def __init__(self, D=8, N=4, P=6):
        super().__init__()
        self.patch = nn.Linear(P, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, N + 1, D))

    def forward(self, x):
        x = self.patch(x)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_matches_eager(backend):
    """Under torch.compile the module holding the bare parameters (here the embedding, as in Hugging Face's
    ViT) runs eagerly, a graph break; the layers after it are compiled. The norms are eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(Embed(), nn.LayerNorm(8), nn.Flatten(), nn.Linear(40, 3)).double()
    x, y = data()
    compiled = torch.compile(model, backend=backend)
    against_per_example(model, lambda s: F.cross_entropy(model(x[s]), y[s], reduction="sum"), x.shape[0],
                        steps=2, batch_loss=lambda: F.cross_entropy(compiled(x), y, reduction="sum"),
                        rtol=1e-9, same_keys=False, loss_reduction="sum")


class Block(nn.Module):
    def __init__(self, D):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(torch.tanh(self.ln(x)))


class TimmViT(ViT):
    """timm's layout: the bare parameters at the root, read in a helper method, the blocks a child."""

    def __init__(self, D=8, N=4, P=6, classes=3):
        super().__init__(D, N, P, classes)
        self.blocks = nn.Sequential(Block(D), Block(D))

    def _pos_embed(self, x):
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed

    def forward(self, x):
        return self.head(self.norm(self.blocks(self._pos_embed(self.patch(x)))).mean(1))


@pytest.mark.parametrize("eager_parent", [True, False])
def test_compiled_root_with_bare_parameters_compiles_its_children(eager_parent, monkeypatch):
    """The root holds the bare parameters (timm's ViT): its own forward and helper methods run eagerly, and
    its children (patch, blocks, norm, head) are compiled, each a graph of its own (before: the whole model
    ran eagerly, nothing captured). The norms are eager's, over two steps; with EagerParent off, nothing is
    captured and the norms are the same."""
    from torch._dynamo.utils import counters

    from elasticlab.gns.layers import eager_parent as ep
    monkeypatch.setattr(ep, "ENABLED", eager_parent)
    torch.manual_seed(0)
    model = TimmViT().double()
    x, y = data()
    want = per_example(model, model, x, y)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        for _ in range(2):
            model.zero_grad()
            F.cross_entropy(compiled(x), y, reduction="sum").backward()
            assert_norms(psn.param_sq_norms(), want, rtol=1e-9, same_keys=False)
    captured = counters["stats"]["calls_captured"]
    assert captured > 0 if eager_parent else captured == 0
    breaks = [k for k in counters["graph_break"] if "set_eval_frame" in k]
    assert breaks == []
    torch._dynamo.reset()


class Positions(nn.Module):
    """Token embeddings plus a positional nn.Embedding on an index without the batch, in the ways models
    write it: HF's ``position_ids`` (1, T), ``arange(T)``, and T5's relative-position bias ((q, k) buckets
    → (1, H, q, k), an additive attention mask), read by SDPA or added to the scores in place."""

    def __init__(self, form, V=11, T=6, H=2, E=4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, H * E), nn.Embedding(2 * T, H * E)
        self.head = nn.Linear(H * E, V)
        self.bias, self.form, self.H = nn.Embedding(2 * T, H), form, H

    def forward(self, idx):
        return self.body(self.tok(idx))

    def body(self, h):
        B, T = h.shape[:2]
        ar = torch.arange(T)
        h = h + (self.pos(ar[None]) if self.form == "row" else self.pos(ar))
        q = h.view(B, T, self.H, -1).transpose(1, 2)
        bias = self.bias(ar[None, :] - ar[:, None] + T).permute(2, 0, 1).unsqueeze(0)       # (1, H, T, T)
        if self.form == "sdpa":
            a = F.scaled_dot_product_attention(q, q, q, attn_mask=bias)
        else:
            scores = q @ q.transpose(-1, -2)
            scores += bias
            a = scores.softmax(-1) @ q
        return self.head(torch.tanh(a.transpose(1, 2).reshape(B, T, -1)))


@pytest.mark.parametrize("form", ["row", "arange", "sdpa"])
@pytest.mark.parametrize("fused", [True, False])
def test_embeddings_on_an_index_without_the_batch_are_followed(form, fused):
    """(before: the readers raised "module 'pos' (Embedding) ... broadcast over the batch"; T5's bias had no
    way out, its buckets being no input of the model)"""
    torch.manual_seed(0)
    model = Positions(form).double()
    idx = torch.randint(0, 11, (5, 6))
    loss = lambda o, t: F.cross_entropy(o.reshape(-1, 11), t.reshape(-1), reduction="sum")   # noqa: E731
    against_per_example(model, lambda s: loss(model(idx[s]), idx[s]), 5, steps=2, rtol=1e-9, same_keys=False,
                        loss_reduction="sum", fused=fused)


class TwoWays(nn.Module):
    """One nn.Embedding called on the batch's tokens and on positions without the batch."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(11, 4), nn.Linear(4, 3)

    def forward(self, idx):
        return self.head(self.emb(idx) + self.emb(torch.arange(idx.shape[1]))).mean(1)


def test_one_embedding_with_and_without_the_batch_is_an_error():
    model, idx = TwoWays().double(), torch.randint(0, 11, (5, 6))
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        with pytest.raises(RuntimeError, match=r"module 'emb' \(Embedding\) ran 2 times in one forward, on "
                                               r"inputs with and without the batch"):
            model(idx).sum().backward()
    del psn


def test_a_batchless_output_used_otherwise_is_named():
    """An embedding without the batch whose output meets the batch by a tensordot: not a broadcast (by a
    matmul, taken per example: the vjp of the matmul on each example's rows, then of the embedding)."""
    class Mixer(nn.Module):
        def __init__(self, matmul=False):
            super().__init__()
            self.mix, self.inp, self.matmul = nn.Embedding(6, 6), nn.Linear(4, 4), matmul

        def forward(self, x):                               # x (B, 6, 4)
            e, h = self.mix(torch.arange(6)), self.inp(x)
            return (e @ h if self.matmul else torch.tensordot(h, e, dims=([1], [1]))).mean(1)

    model, x = Mixer(matmul=True).double(), torch.randn(5, 6, 4, dtype=torch.float64)
    want = example_param_sq_norms(model, (model(x[b:b + 1]).pow(2).sum() for b in range(5)))
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        model(x).pow(2).sum().backward()
        got = psn.param_sq_norms()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-12, msg=k)
    model = Mixer().double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        model(x).pow(2).sum().backward()
        why = (r"module 'mix' \(Embedding\) ran without the batch \(its output has shape \(6, 6\), the "
               r"batch 5\), and that output is used by .*tensordot.*expand its input over the batch")
        with pytest.raises(RuntimeError, match=why):
            psn.sq_norms()


@pytest.mark.parametrize("reentrant", [False, True])
def test_positions_under_activation_checkpointing(reentrant):
    torch.manual_seed(0)
    inner = Positions("row").double()

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, idx):
            return checkpoint(self.inner.body, self.inner.tok(idx), use_reentrant=reentrant)

    model, idx = Wrapped(), torch.randint(0, 11, (5, 6))
    loss = lambda o, t: F.cross_entropy(o.reshape(-1, 11), t.reshape(-1), reduction="sum")   # noqa: E731
    want = example_param_sq_norms(inner, (loss(inner(idx[b:b + 1]), idx[b:b + 1]) for b in range(5)))
    with PerSampleGradNorms(model, loss_reduction="sum", fused=False) as psn:
        loss(model(idx), idx).backward()
        got = psn.param_sq_norms()
    for k in want:
        torch.testing.assert_close(got[f"inner.{k}"], want[k], rtol=1e-9, atol=1e-12, msg=k)


class LearnedPositions(nn.Module):
    """A leaf of no registered type (the generic rule) making its positions itself: (1, T, D), BART's way."""

    def __init__(self, T=6, D=4):
        super().__init__()
        self.table = nn.Parameter(torch.randn(T, D))

    def forward(self, idx):
        return F.embedding(torch.arange(idx.shape[1])[None], self.table)


@pytest.mark.parametrize("B", [5, 1])
def test_a_generic_layer_whose_output_lacks_the_batch_is_followed(B):
    """(before: "vmap: Expected at least one Tensor to vmap over", or with B = 1 exact by the generic rule)"""
    torch.manual_seed(0)
    model = nn.ModuleDict({"tok": nn.Embedding(11, 4), "pos": LearnedPositions(), "head": nn.Linear(4, 3)})

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, idx):
            return self.m.head(torch.tanh(self.m.tok(idx) + self.m.pos(idx))).mean(1)
    net, idx = Net().double(), torch.randint(0, 11, (B, 6))
    y = torch.randint(0, 3, (B,))
    check(net, idx, y, steps=2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("autocast", [False, True])
def test_vit_and_positions_on_the_device_under_autocast(device, autocast):
    """The ViT's bare parameters and the batch-less positional embeddings, float32 or bf16 autocast on the
    device, against the float64 reference on the CPU: exact to float32 (bf16: median relative error of each
    parameter's norms under 2%)."""
    torch.manual_seed(3)
    cases = ((ViT(D=16, N=8, P=6), torch.randn(16, 8, 6), torch.randint(0, 3, (16,))),
             (Positions("sdpa"), torch.randint(0, 11, (16, 6)), None))
    for model, x, y in cases:
        y = x if y is None else y

        def loss(o, t):
            return F.cross_entropy(o.float().reshape(-1, o.shape[-1]), t.reshape(-1), reduction="sum")
        ref = example_param_sq_norms(model.double(), (loss(model(x[b:b + 1].double() if x.is_floating_point()
                                                                  else x[b:b + 1]), y[b:b + 1])
                                                      for b in range(x.shape[0])))
        model, x, y = model.float().to(device), x.to(device), y.to(device)
        with PerSampleGradNorms(model, loss_reduction="sum") as psn:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            loss(out, y).backward()
            got = psn.param_sq_norms()
        for k, want in ref.items():
            g = got[k].double().cpu()
            if autocast:
                assert float(((g - want).abs() / want.clamp_min(1e-30)).median()) < 0.02, k
            else:
                torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-8, msg=k)


class Latents(nn.Module):
    """Perceiver's learned latents, expanded to a batch size passed as a number (no tensor input), by a
    module with children."""

    def __init__(self, N=3, D=8):
        super().__init__()
        self.latents, self.proj = nn.Parameter(torch.randn(N, D)), nn.Linear(D, D)

    def forward(self, batch_size):
        return self.proj(self.latents.expand(batch_size, -1, -1))


def test_latents_expanded_to_a_batch_size_given_as_a_number():
    """The batch is then the model's (dim 0 of its input)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lat, self.inp, self.head = Latents(), nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.inp(x) + self.lat(x.shape[0]).mean(1, keepdim=True))).mean(1)
    check(Net().double(), *data(), steps=2)


def test_no_hook_on_a_parameter_runs_in_the_per_example_vjps():
    """The vjps that map a broadcast's per-example gradients back start from aliases of the parameters (a
    layer's by torch.func on a detached copy), so a tensor hook on a parameter runs once a backward, with
    the batch's gradient (before: also inside those vjps, batched: GNSMonitor's micro-batch hooks failed
    with "Batching rule not implemented for aten::detach" on HF's GPT-2)."""
    torch.manual_seed(0)
    for model, x, y in ((ViT().double(), *data()), (Positions("sdpa").double(), torch.randint(0, 11, (5, 6)),
                                                   None)):
        y = x if y is None else y
        seen = []
        for name, p in model.named_parameters():
            p.register_hook(lambda g, name=name, seen=seen: seen.append((name, tuple(g.shape))))
        with PerSampleGradNorms(model, loss_reduction="sum") as psn:
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum").backward()
            psn.sq_norms()
        names = [n for n, _ in seen]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters())        # each once
        assert all(shape == tuple(model.get_parameter(n).shape) for n, shape in seen)


def test_positions_without_the_batch_under_compile_are_named():
    """Under torch.compile such a call is not followed: the readers raise naming it, or strict=False leaves
    it out (listed in left_out) with the other norms exact (before: param_sq_norms gave it a norm of shape
    (1,), with no error)."""
    torch.manual_seed(0)
    model, idx = Positions("row").double(), torch.randint(0, 11, (5, 6))
    loss = lambda o, t: F.cross_entropy(o.reshape(-1, 11), t.reshape(-1), reduction="sum")   # noqa: E731
    want = example_param_sq_norms(model, (loss(model(idx[b:b + 1]), idx[b:b + 1]) for b in range(5)))
    run = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, eager_first=False, loss_reduction="sum") as psn:
        loss(run(idx), idx).backward()
        with pytest.raises(RuntimeError, match=r"module 'pos' \(Embedding\) ran without the batch .* under "
                                               r"torch.compile"):
            psn.param_sq_norms()
    with PerSampleGradNorms(model, eager_first=False, loss_reduction="sum", strict=False) as psn:
        model.zero_grad()
        loss(run(idx), idx).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = psn.param_sq_norms()
        assert "pos.weight" not in got and "pos.weight" in psn.left_out
        torch.testing.assert_close(got["tok.weight"], want["tok.weight"], rtol=1e-9, atol=1e-12)


class Learned(nn.Embedding):
    """BART's positional embedding: a forward of its own, handed the batched ids (for their shape) and the
    positions by keyword, which it offsets: (1, T, D), not a lookup of its first argument."""

    def __init__(self, T, D):
        super().__init__(T + 2, D)

    def forward(self, input_ids, cache_length=0, position_ids=None):
        return super().forward(position_ids.unsqueeze(0) + 2 + cache_length)


class Table(nn.Module):
    """A leaf with no rule of its own (the generic rule): a gained table of positions, (T, D) on
    ``arange(T)``."""

    def __init__(self, T, D):
        super().__init__()
        self.table, self.gain = nn.Parameter(torch.randn(T, D)), nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, positions):
        return self.table[positions] * self.gain


class Absolute(nn.Module):
    """Token embeddings plus a positional layer on an index without the batch (``pos``: an nn.Embedding,
    BART's :class:`Learned`, or the generic :class:`Table`), its output used as ``use`` says: ``add``
    (GPT-2, through ``.to``), ``inplace`` (BERT's ``embeddings += …``), ``expand`` (an explicit expand to
    the batch), or ways the expansion would change: ``sum`` (a reduction over its dim 0), ``index`` (its row
    0), ``shape`` (read), ``twice`` (two uses), ``dropout`` (a mask per example)."""

    def __init__(self, use, V=11, T=6, D=8, pos="embedding"):
        super().__init__()
        self.tok, self.head, self.use, self.kind = nn.Embedding(V, D), nn.Linear(D, V), use, pos
        self.pos = {"embedding": nn.Embedding, "learned": Learned, "table": Table}[pos](T, D)

    def forward(self, idx):
        h, T = self.tok(idx), idx.shape[1]
        if self.kind == "embedding":
            p = self.pos(torch.arange(T)[None])                               # (1, T, D)
        elif self.kind == "learned":
            p = self.pos(idx, 0, position_ids=torch.arange(T))               # (1, T, D)
        else:
            p = self.pos(torch.arange(T))                                     # (T, D)
        if self.use == "add":
            h = h + p.to(h.dtype)
        elif self.use == "inplace":
            h += p
        elif self.use == "expand":
            h = h * p.expand(idx.shape[0], -1, -1)
        elif self.use == "sum":
            h = h + p.sum(0)
        elif self.use == "index":
            h = h + p[0]
        elif self.use == "shape":
            h = h + p.reshape(p.shape)
        elif self.use == "twice":
            h = h + p + torch.tanh(h) * p
        elif self.use == "dropout":
            h = h + F.dropout(p, 0.5, training=True)
        return self.head(torch.tanh(h))


def _absolute_steps(use, fused, first="eager", strict=True, pos="embedding"):
    """The model's norms over an eager step of the model (``first`` "eager"), or none (``first``
    "stance": PerSampleGradNorms runs the compiled model's first step eagerly; "compiled": compiled from the
    first, ``eager_first=False``), then two steps of the compiled (aot_eager) one, each against one backward
    per example (float64); the expansion changes no loss."""
    torch.manual_seed(0)
    model, idx = Absolute(use, pos=pos).double(), torch.randint(0, 11, (5, 6))
    loss = lambda m, x, s: F.cross_entropy(m(x[s]).reshape(-1, 11), x[s].reshape(-1), reduction="sum")  # noqa: E731
    eager, compiled = ([idx], [idx] * 2) if first == "eager" else ([], [idx] * (2 + (first == "stance")))
    eager_then_compiled(model, loss, eager, compiled, loss_reduction="sum", fused=fused, strict=strict,
                        eager_first=first != "compiled")


@pytest.mark.parametrize("use", ["add", "inplace", "expand"])
@pytest.mark.parametrize("fused", [True, False])
def test_positions_broadcast_only_are_expanded_under_compile_after_an_eager_step(use, fused):
    """An eager step sees the batch-less output only broadcast over the batch; the compiled steps after it
    expand it (and its index) over the batch, and the norms are one backward per example's (before: the
    readers raised naming 'pos' under compile)."""
    _absolute_steps(use, fused)


@pytest.mark.parametrize("pos", ["learned", "table"])
@pytest.mark.parametrize("use", ["add", "inplace", "expand"])
@pytest.mark.parametrize("fused", [True, False])
def test_positional_layers_of_their_own_are_expanded_under_compile_after_an_eager_step(pos, use, fused):
    """A batch-less call that is not a lookup of its first argument (BART's embedding, making its positions
    from a keyword; a generic leaf on ``arange(T)`` giving (T, D)): the compiled steps expand its output
    alone, and its norms are the vjp of its one forward at each example's gradient of the expansion
    (before: the readers raised naming it at every compiled step, after an eager step too)."""
    _absolute_steps(use, fused, pos=pos)


@pytest.mark.parametrize("pos", ["learned", "table"])
@pytest.mark.parametrize("use", ["sum", "twice"])
def test_positional_layers_of_their_own_used_otherwise_are_still_named(pos, use):
    with pytest.raises(RuntimeError, match=r"module 'pos' \((Learned|Table)\) ran without the batch .* under "
                                           r"torch.compile.* an eager step saw its output used otherwise"):
        _absolute_steps(use, True, pos=pos)


def test_positions_under_compile_without_an_eager_step_are_still_named():
    with pytest.raises(RuntimeError, match=r"module 'pos' \(Embedding\) ran without the batch .* run one "
                                           r"step eagerly first"):
        _absolute_steps("add", True, first="compiled")


@pytest.mark.parametrize("use", ["sum", "index", "shape", "twice"])
def test_positions_used_otherwise_are_not_expanded_under_compile(use):
    """A use the expansion would change (or one this rule does not read as a broadcast), seen in the eager
    step, rules it out: the compiled steps refuse by name, and their loss is the plain model's."""
    with pytest.raises(RuntimeError, match=r"module 'pos' \(Embedding\) ran without the batch .* under "
                                           r"torch.compile.* an eager step saw its output used otherwise"):
        _absolute_steps(use, True, strict=True)


@pytest.mark.parametrize("use", ["add", "inplace", "expand", "sum", "index", "shape", "twice", "dropout"])
def test_what_an_eager_step_learns_of_a_positional_output(use):
    """The state kept for compile: (dims, leading dims added) where the output was only broadcast over the
    batch, False where it was used otherwise."""
    torch.manual_seed(0)
    model, idx = Absolute(use).double(), torch.randint(0, 11, (5, 6))
    with PerSampleGradNorms(model, loss_reduction="sum", strict=False) as psn:
        model(idx).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            psn.param_sq_norms()
        learned = next(s for s in psn._slots if s.module is model.pos).follow.expand
    assert learned == ((3, 0) if use in ("add", "inplace", "expand") else False)


class BiasTable(nn.Module):
    """A bare table (with a child, frozen: the eager-parent rule) returned unbroadcast, its caller adding it
    to the attention scores, as a relative position bias module does."""

    def __init__(self, H=2, T=6):
        super().__init__()
        self.table, self.unused = nn.Parameter(torch.randn(H, T, T)), nn.Linear(2, 2).requires_grad_(False)

    def forward(self):
        return self.table.unsqueeze(0)                                        # (1, H, T, T)


class Scores(nn.Module):
    def __init__(self, H=2, T=6, D=4):
        super().__init__()
        self.inp, self.bias, self.head, self.H = nn.Linear(D, H * D), BiasTable(H, T), nn.Linear(H * T, 3), H

    def forward(self, x):
        B, T, _ = x.shape
        q = self.inp(x).view(B, T, self.H, -1).transpose(1, 2)                # (B, H, T, D)
        scores = q @ q.transpose(-1, -2) + self.bias()
        return self.head(scores.softmax(-1).mean(-1).reshape(B, -1))


def test_a_followed_output_returned_to_compiled_code_is_refused_by_name():
    """Eagerly the table is followed from the module's output to its caller's broadcast (exact); under
    torch.compile the caller is compiled and cannot follow it: an error naming the module and its
    parameter, raised at the forward, not a Dynamo crash."""
    import torch._dynamo
    torch.manual_seed(0)
    model, x, y = Scores().double(), torch.randn(5, 6, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    loss = lambda o, t: F.cross_entropy(o, t, reduction="sum")                # noqa: E731
    against_per_example(model, lambda s: loss(model(x[s]), y[s]), 5, rtol=1e-9, same_keys=False,
                        loss_reduction="sum")
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, eager_first=False, loss_reduction="sum"):
        with pytest.raises(RuntimeError, match=r"module 'bias' \(BiasTable\) returns \['table'\] not yet "
                                               r"broadcast over the batch .* under torch.compile"):
            run(x)


@pytest.mark.parametrize("use", ["add", "expand"])
@pytest.mark.parametrize("fused", [True, False])
def test_positions_under_compile_need_no_eager_step_of_the_users(use, fused):
    """Three steps of the compiled model and none of the model itself: PerSampleGradNorms runs the first
    eagerly (eager_first) and learns the broadcast there; all three exact (before: refused by name)."""
    _absolute_steps(use, fused, first="stance")


@pytest.mark.parametrize("own_eager_step", [True, False])
def test_gns_monitor_on_a_compiled_model_after_an_eager_step(own_eager_step):
    """GNSMonitor over a model with a batch-less positional embedding: its first step eager (the model
    itself, or the compiled one run eagerly by eager_first), the later ones compiled, every step measured
    per example with the estimates of an all-eager run."""
    import torch._dynamo

    from elasticlab.gns import GNSMonitor

    def train(compiled: bool):
        torch.manual_seed(0)
        model = Absolute("add").double()
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        mon, opt = GNSMonitor(model, every=1), torch.optim.SGD(model.parameters(), lr=0.05)
        for m in (model if own_eager_step else run, run, run):
            idx = torch.randint(0, 11, (8, 6))
            with mon.step():
                F.cross_entropy(m(idx).reshape(-1, 11), idx.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        return mon

    eager, mixed = train(False), train(True)
    assert mixed.skipped == 0 and [h["method"] for h in mixed.history] == ["per_example"] * 3
    for a, b in zip(eager.history, mixed.history):
        for k in ("b_simple", "grad_sq", "trace_cov"):
            assert b[k] == pytest.approx(a[k], rel=1e-9), k
