"""PerSampleGradNorms for GroupNorm, RMSNorm, BatchNorm (eval) and MultiheadAttention against torch.func
(vmap of grad), float64; the BatchNorm training-mode error; bfloat16 autocast against float32."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layer_check import assert_grads_and_norms, check, grads_of, randomise_affine, sq_loss
from torch import nn
from torch.func import functional_call, grad, vmap

from elasticlab.gns import RULES, PerSampleGradNorms, rule_for
from elasticlab.gns.reference import func_param_sq_norms, func_sq_norms

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
red_fused = dict(reduction=st.sampled_from(["mean", "sum"]), fused=st.booleans(), B=st.integers(2, 4))


# ------------------------------------------------------------------------------------------------ GroupNorm
@SETTINGS
@given(G=st.integers(1, 3), cpg=st.integers(1, 2),
       spatial=st.sampled_from([(), (1,), (5,), (3, 4), (2, 3, 2)]), **red_fused)
def test_groupnorm(G, cpg, spatial, reduction, fused, B):
    if cpg * math.prod(spatial) == 1:                  # group_norm needs more than one value per group
        cpg = 2
    m = randomise_affine(nn.GroupNorm(G, G * cpg)).double()
    x = 3 * torch.randn(B, G * cpg, *spatial, dtype=torch.float64) + 1
    check(m, x, reduction, fused)


def test_groupnorm_channels_last_and_frozen_bias():
    m = randomise_affine(nn.GroupNorm(2, 4)).double()
    m.bias.requires_grad_(False)
    x = torch.randn(3, 4, 5, 6, dtype=torch.float64).to(memory_format=torch.channels_last)
    # torch 2.13's own GroupNorm backward segfaults on a channels-last input that needs no gradient (the
    # plain-autograd comparison in check() would hit it); the fused form never asks ATen for that case.
    x.requires_grad_(True)
    for fused in (True, False):
        n = check(m, x, "mean", fused)
        assert set(n.param_sq_norms()) == {"weight"}
    x = x.detach()                                     # fused, without an input gradient: norms only
    y = torch.randn_like(x)
    with PerSampleGradNorms(m, loss_reduction="sum") as n:
        sq_loss(m(x), y).backward()
    torch.testing.assert_close(n.param_sq_norms()["weight"], func_param_sq_norms(m, sq_loss, x, y)["weight"])


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock with GroupNorm (``norm_layer=lambda c: nn.GroupNorm(2, c)``)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.GroupNorm(2, cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.GroupNorm(2, cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.GroupNorm(2, cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.bn1 = nn.GroupNorm(2, 4)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(4, 4, 1)
        self.layer2 = BasicBlock(4, 6, 2)
        self.fc = nn.Linear(6, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fused", [True, False])
def test_groupnorm_resnet_block(reduction, fused):
    torch.manual_seed(0)
    model = randomise_affine(TinyResNet()).double()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss = lambda o, t: F.cross_entropy(o, t, reduction="sum")      # noqa: E731
    n = check(model, x, reduction, fused, loss_fn=loss, y=y)
    torch.testing.assert_close(n.sq_norms(), func_sq_norms(model, loss, x, y), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------ RMSNorm
@SETTINGS
@given(shape=st.sampled_from([(4,), (3, 4)]), seq=st.sampled_from([(), (1,), (5,), (2, 3)]),
       eps=st.sampled_from([None, 1e-3]), scale=st.sampled_from([0.02, 1.0, 3.0]), **red_fused)
def test_rmsnorm(shape, seq, eps, scale, reduction, fused, B):
    m = nn.RMSNorm(shape, eps=eps).double()
    with torch.no_grad():
        m.weight.normal_()
    x = scale * torch.randn(B, *seq, *shape, dtype=torch.float64) + 0.1 * scale
    check(m, x, reduction, fused)


def test_rmsnorm_in_a_model():
    model = nn.Sequential(nn.Linear(5, 6), nn.RMSNorm(6), nn.Linear(6, 2)).double()
    randomise_affine(model)
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    for fused in (True, False):
        for reduction in ("mean", "sum"):
            check(model, x, reduction, fused)


# ------------------------------------------------------------------------------------------------ BatchNorm
BN_SHAPES = {nn.BatchNorm1d: [(), (5,)], nn.BatchNorm2d: [(3, 4)], nn.BatchNorm3d: [(2, 3, 2)]}


def eval_bn(cls, C):
    m = randomise_affine(cls(C)).double()
    with torch.no_grad():
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
    return m.eval()


@SETTINGS
@given(case=st.sampled_from([(c, s) for c, ss in BN_SHAPES.items() for s in ss]), C=st.integers(1, 4),
       **red_fused)
def test_batchnorm_eval(case, C, reduction, fused, B):
    cls, spatial = case
    m = eval_bn(cls, C)
    x = 2 * torch.randn(B, C, *spatial, dtype=torch.float64) + 0.5
    check(m, x, reduction, fused)


def test_batchnorm_eval_in_a_cnn_and_syncbatchnorm():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), eval_bn(nn.BatchNorm2d, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 3 * 3, 2)).double().eval()
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    for fused in (True, False):
        check(model, x, "mean", fused)
    sync = nn.SyncBatchNorm(3).double()
    sync.load_state_dict(eval_bn(nn.BatchNorm1d, 3).state_dict())
    check(sync.eval(), torch.randn(4, 3, 5, dtype=torch.float64), "sum", False)


@pytest.mark.parametrize("fused", [True, False])
def test_batchnorm_batch_statistics_are_an_error(fused):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x = torch.randn(6, 3)
    with PerSampleGradNorms(model, fused=fused), pytest.raises(ValueError) as e:
        model(x)
    msg = str(e.value)
    for part in ("BatchNorm1d in training mode", "couple the examples", "eval mode", "freeze", "GroupNorm",
                 "ModuleValidator.fix"):
        assert part in msg, part
    model.eval()                                       # running statistics: fine
    with PerSampleGradNorms(model, fused=fused) as n:
        model(x).sum().backward()
    assert set(n.layer_sq_norms()) == {"0", "1", "2"}
    model.train()                                      # frozen affine parameters: BatchNorm has no slot
    model[1].requires_grad_(False)
    with PerSampleGradNorms(model, fused=fused) as n:
        model(x).sum().backward()
    assert set(n.layer_sq_norms()) == {"0", "2"}
    # No running statistics: batch statistics in eval mode too.
    bn = nn.BatchNorm1d(4, track_running_stats=False).eval()
    with PerSampleGradNorms(bn, fused=fused), pytest.raises(ValueError, match="track_running_stats=False"):
        bn(torch.randn(5, 4))


@pytest.mark.parametrize("layer, shape", [(nn.LayerNorm(5), (5,)), (nn.GroupNorm(2, 4), (4,)),
                                          (nn.LayerNorm([2, 3]), (2, 3))])
def test_fused_norm_layer_without_a_batch_dimension_is_an_error(layer, shape):
    """The fused forward of LayerNorm and GroupNorm names the layer and the shape (torch's LayerNorm itself
    takes an input without a batch dimension)."""
    with PerSampleGradNorms(layer), pytest.raises(ValueError) as e:
        layer(torch.randn(*shape))
    msg = str(e.value)
    assert "batch dimension first" in msg and type(layer).__name__ in msg and str(shape) in msg, msg


# ------------------------------------------------------------------------------------------------ attention
class Attn(nn.Module):
    """x (B, L + S, D) holds the query (first L positions) and the memory; kind: "self" (query is key is
    value), "kv" (key is value), "qkv" (three tensors). Returns the batch-first output and the weights."""

    def __init__(self, mha, kind, L, call):
        super().__init__()
        self.mha, self.kind, self.L, self.call = mha, kind, L, call

    def forward(self, x, kpm=None, mask3=None):
        m, L, E = self.mha, self.L, self.mha.embed_dim
        q = x[:, :L, :E]
        if self.kind == "self":
            k = v = q
        else:
            k = x[:, L:, :m.kdim]
            v = k if self.kind == "kv" else x[:, L:, x.shape[2] - m.vdim:]
        if not m.batch_first:
            q2 = q.transpose(0, 1)
            k2 = q2 if k is q else k.transpose(0, 1)
            v2 = k2 if v is k else v.transpose(0, 1)
            q, k, v = q2, k2, v2
        kw = dict(self.call)
        if kpm is not None:
            kw["key_padding_mask"] = kpm
        if mask3 is not None:
            kw["attn_mask"] = mask3.reshape(-1, *mask3.shape[2:])
        out, w = m(q, k, v, **kw)
        return (out if m.batch_first else out.transpose(0, 1)), w


def attn_loss(out, w, y, yw):
    loss = (out - y).pow(2).sum()
    return loss if w is None else loss + (w * yw).sum()


def attn_reference(model, x, y, yw, kpm, mask3):
    """{param: (B,)} per-example squared gradient norms by vmap of grad over (x, kpm, mask3)."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    extra = [t for t in (kpm, mask3) if t is not None]

    def one(p, xi, yi, ywi, *rest):
        rest = list(rest)
        kw = {}
        if kpm is not None:
            kw["kpm"] = rest.pop(0).unsqueeze(0)
        if mask3 is not None:
            kw["mask3"] = rest.pop(0).unsqueeze(0)
        out, w = functional_call(model, p, (xi.unsqueeze(0),), kw)
        return attn_loss(out, w, yi.unsqueeze(0), None if w is None else ywi.unsqueeze(0))

    yw_ = yw if yw is not None else torch.zeros(x.shape[0])
    g = vmap(grad(one), in_dims=(None, 0, 0, 0, *[0] * len(extra)))(params, x, y, yw_, *extra)
    return {k: v.reshape(v.shape[0], -1).pow(2).sum(1) for k, v in g.items()}


def check_attn(model, x, kpm, mask3, reduction, fused=True):
    kw = {k: v for k, v in (("kpm", kpm), ("mask3", mask3)) if v is not None}
    torch.manual_seed(1)
    with torch.no_grad():
        out0, w0 = model(x, **kw)
    y = torch.randn_like(out0)
    yw = None if w0 is None else torch.randn_like(w0)
    ref = attn_reference(model, x, y, yw, kpm, mask3)
    div = x.shape[0] if reduction == "mean" else 1
    model.zero_grad()
    (attn_loss(*model(x, **kw), y, yw) / div).backward()
    plain = grads_of(model)
    model.zero_grad()
    with PerSampleGradNorms(model, loss_reduction=reduction, fused=fused) as n:
        out, w = model(x, **kw)
        (attn_loss(out, w, y, yw) / div).backward()
    torch.testing.assert_close(out, out0, rtol=1e-10, atol=1e-12)
    if w0 is None:
        assert w is None
    else:
        torch.testing.assert_close(w, w0, rtol=1e-10, atol=1e-12)
    assert_grads_and_norms(model, n, plain, ref)
    return n


def make_attn(B, L, S, H, hd, kind, batch_first, dims, bias, add_bias_kv, add_zero_attn, need_weights,
              average, mask, with_kpm):
    E = H * hd
    kdim, vdim = (E, E) if dims == "same" else (E + 1, E + 1 if kind == "kv" else E + 2)
    if kind == "self":
        S = L
    if mask == "causal":
        S = L
    mha = nn.MultiheadAttention(E, H, bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
                                kdim=kdim, vdim=vdim, batch_first=batch_first).double()
    with torch.no_grad():                               # off the init (zero biases) so every term matters
        for p in mha.parameters():
            p.normal_(0, 0.5)
    call = dict(need_weights=need_weights, average_attn_weights=average)
    mask3 = None
    if mask == "bool2d":
        am = torch.rand(L, S) < 0.3
        am[:, 0] = False                                # no fully masked row
        call["attn_mask"] = am
    elif mask == "float2d":
        call["attn_mask"] = torch.randn(L, S, dtype=torch.float64)
    elif mask == "float3d":
        mask3 = torch.randn(B, H, L, S, dtype=torch.float64)
    elif mask == "causal":
        call["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
        call["is_causal"] = True
    kpm = None
    if with_kpm:
        kpm = torch.rand(B, S) < 0.4
        kpm[:, 0] = False
        if mask not in (None, "bool2d"):                # same mask types (mixed ones are deprecated)
            kpm = torch.zeros(B, S, dtype=torch.float64).masked_fill(kpm, float("-inf"))
    model = Attn(mha, kind, L, call)
    x = torch.randn(B, L + S, max(E, kdim, vdim) + 1, dtype=torch.float64)
    return model, x, kpm, mask3


@settings(max_examples=15, deadline=None)
@given(B=st.integers(2, 3), L=st.integers(1, 4), S=st.integers(1, 4), H=st.integers(1, 2),
       hd=st.integers(1, 3),
       kind=st.sampled_from(["self", "kv", "qkv"]), batch_first=st.booleans(),
       dims=st.sampled_from(["same", "same", "diff"]), bias=st.booleans(), add_bias_kv=st.booleans(),
       add_zero_attn=st.booleans(), need_weights=st.booleans(), average=st.booleans(),
       mask=st.sampled_from([None, "bool2d", "float2d", "float3d", "causal"]), with_kpm=st.booleans(),
       reduction=st.sampled_from(["mean", "sum"]))
def test_mha(B, L, S, H, hd, kind, batch_first, dims, bias, add_bias_kv, add_zero_attn, need_weights, average,
             mask, with_kpm, reduction):
    if dims == "diff" and kind == "self":
        kind = "kv"
    model, x, kpm, mask3 = make_attn(B, L, S, H, hd, kind, batch_first, dims, bias, add_bias_kv,
                                     add_zero_attn, need_weights, average, mask, with_kpm)
    check_attn(model, x, kpm, mask3, reduction)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", ["self", "kv", "qkv"])
def test_mha_batch_first_and_cross_attention(batch_first, kind):
    torch.manual_seed(0)
    model, x, kpm, mask3 = make_attn(3, 4, 5, 2, 3, kind, batch_first, "same", True, False, False, False,
                                     True, "bool2d", True)
    n = check_attn(model, x, kpm, mask3, "mean")
    assert set(n.param_sq_norms()) == {"mha.in_proj_weight", "mha.in_proj_bias", "mha.out_proj.weight",
                                       "mha.out_proj.bias"}


def test_mha_separate_weights_bias_kv_and_masks():
    torch.manual_seed(0)
    model, x, kpm, mask3 = make_attn(3, 3, 4, 2, 2, "qkv", False, "diff", True, True, True, True, False,
                                     "float3d", True)
    n = check_attn(model, x, kpm, mask3, "sum")
    assert {"mha.q_proj_weight", "mha.k_proj_weight", "mha.v_proj_weight", "mha.bias_k",
            "mha.bias_v"} <= set(n.param_sq_norms())


@pytest.mark.parametrize("frozen", ["in_proj_weight", "out_proj"])
def test_mha_partly_frozen(frozen):
    torch.manual_seed(0)
    model, x, kpm, mask3 = make_attn(3, 4, 4, 2, 2, "self", True, "same", True, False, False, False, True,
                                     None, False)
    if frozen == "out_proj":
        model.mha.out_proj.requires_grad_(False)
    else:
        model.mha.in_proj_weight.requires_grad_(False)
    n = check_attn(model, x, kpm, mask3, "mean")
    assert not any(frozen in k for k in n.param_sq_norms())


def test_mha_out_proj_resolves_to_linear_rule_and_fused_form_runs_without_fused():
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    assert rule_for(mha.out_proj) is RULES[nn.Linear]
    assert RULES[nn.MultiheadAttention].norms is None           # fused only: used with fused=False too
    x = torch.randn(2, 3, 4)
    with PerSampleGradNorms(mha, fused=False) as n:
        mha(x, x, x)[0].sum().backward()
        assert {"in_proj_weight", "in_proj_bias", "out_proj.weight"} <= set(n.param_sq_norms())
    with PerSampleGradNorms(mha) as n, pytest.raises(ValueError, match="batch dimension"):
        mha(x[0], x[0], x[0])
    assert "forward" not in mha.__dict__
    with n:
        mha(x, x, x)[0].sum().backward()
    assert set(n.layer_sq_norms()) == {"", "out_proj"}


@pytest.mark.parametrize("need_weights", [True, False])
def test_mha_dropout_in_training_matches_the_original_forward(need_weights):
    mha = nn.MultiheadAttention(6, 2, dropout=0.3, batch_first=True).double().train()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    torch.manual_seed(7)
    out0, w0 = mha(x, x, x, need_weights=need_weights)
    out0.sum().backward()
    plain = grads_of(mha)
    mha.zero_grad()
    with PerSampleGradNorms(mha) as n:
        torch.manual_seed(7)
        out, w = mha(x, x, x, need_weights=need_weights)
        out.sum().backward()
    torch.testing.assert_close(out, out0)
    if need_weights:
        torch.testing.assert_close(w, w0)
    for k, g in grads_of(mha).items():
        torch.testing.assert_close(g, plain[k], msg=k)
    assert n.sq_norms().shape == (3,)


class Encoder(nn.Module):
    """A TransformerEncoderLayer (batch first: its Linear and LayerNorm layers need the batch dimension first,
    which a batch_first=False layer's feed-forward block does not have) and a head."""

    def __init__(self, norm_first):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(6, 2, dim_feedforward=8, dropout=0.0, batch_first=True,
                                                norm_first=norm_first)
        self.head = nn.Linear(6, 3)

    def forward(self, x):                              # x (B, T, 6)
        return self.head(self.layer(x).mean(1))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_encoder_layer(norm_first, fused):
    torch.manual_seed(0)
    model = Encoder(norm_first).double()
    x = torch.randn(4, 5, 6, dtype=torch.float64)
    check(model, x, "mean", fused)


# ------------------------------------------------------------------------------------------------ autocast
class ConvGN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.Linear(8 * 36, 5)

    def forward(self, x):
        return self.fc(F.relu(self.gn(self.conv(x))).flatten(1))


class SeqRMS(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.rms, self.out = nn.Linear(12, 16), nn.RMSNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.rms(self.up(x))).mean(1)


class SeqAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.attn, self.out = nn.Linear(12, 16), nn.MultiheadAttention(16, 2, batch_first=True), \
            nn.Linear(16, 4)

    def forward(self, x):
        h = self.up(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0]).mean(1)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("which", ["groupnorm", "rmsnorm", "attn"])
def test_bf16_autocast_close_to_float32(which, fused):
    torch.manual_seed(0)
    model = randomise_affine({"groupnorm": ConvGN, "rmsnorm": SeqRMS, "attn": SeqAttn}[which]())
    x = torch.randn(16, 3, 6, 6) if which == "groupnorm" else torch.randn(16, 10, 12)
    y = torch.randint(0, 5 if which == "groupnorm" else 4, (16,))
    layer = {"groupnorm": "gn", "rmsnorm": "rms", "attn": "attn"}[which]

    def norms(autocast):
        model.zero_grad()
        with PerSampleGradNorms(model, fused=fused) as n:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            F.cross_entropy(out.float(), y).backward()
        layers = n.layer_sq_norms()
        assert all(v.dtype == torch.float32 for v in layers.values())
        return n.sq_norms(), layers[layer]

    tot32, layer32 = norms(False)
    tot16, layer16 = norms(True)
    for got, want in ((tot16, tot32), (layer16, layer32)):
        rel = ((got - want).abs() / want).median()
        assert rel < 0.02, float(rel)
