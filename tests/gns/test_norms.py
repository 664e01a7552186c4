"""PerSampleGradNorms against a torch.func (vmap of grad) reference, every layer type, float64."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from elasticlab.gns import PerSampleGradNorms, form_choice
from elasticlab.gns.layers import broadcast_params
from elasticlab.gns.reference import func_param_sq_norms, func_sq_norms

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def sq_loss(out, y):
    """A per-example loss, summed over the batch: ℓ_i = ‖out_i − y_i‖²."""
    return (out - y).pow(2).sum()


def check(model, x, reduction, fused, form=None, monkeypatch=None):
    model = model.double()
    torch.manual_seed(1)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    ref = func_param_sq_norms(model, sq_loss, x, y)
    if form is not None:
        monkeypatch.setattr(form_choice, "use_gram", lambda *a, **k: form == "gram")
    with PerSampleGradNorms(model, loss_reduction=reduction, fused=fused) as n:
        loss = sq_loss(model(x), y)
        if reduction == "mean":
            loss = loss / x.shape[0]
        loss.backward()
    got = n.param_sq_norms()
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-10, msg=k)
    torch.testing.assert_close(n.sq_norms(), sum(ref.values()), rtol=1e-6, atol=1e-10)
    return n


common = dict(reduction=st.sampled_from(["mean", "sum"]), fused=st.booleans(), bias=st.booleans(),
              form=st.sampled_from([None, "gram", "outer"]), B=st.integers(2, 5))


@SETTINGS
@given(din=st.integers(1, 7), dout=st.integers(1, 7), seq=st.sampled_from([(), (1,), (5,), (3, 2)]), **common)
def test_linear(monkeypatch, din, dout, seq, reduction, fused, bias, form, B):
    x = torch.randn(B, *seq, din, dtype=torch.float64)
    check(nn.Linear(din, dout, bias=bias), x, reduction, fused, form, monkeypatch)


@SETTINGS
@given(cin=st.integers(1, 3), cout=st.integers(1, 3), k=st.integers(1, 3), stride=st.integers(1, 2),
       pad=st.integers(0, 2), dil=st.integers(1, 2), groups=st.sampled_from([1, 2]), L=st.integers(6, 9),
       **common)
def test_conv1d(monkeypatch, cin, cout, k, stride, pad, dil, groups, L, reduction, fused, bias, form, B):
    m = nn.Conv1d(cin * groups, cout * groups, k, stride=stride, padding=pad, dilation=dil, groups=groups,
                  bias=bias)
    check(m, torch.randn(B, cin * groups, L, dtype=torch.float64), reduction, fused, form, monkeypatch)


@SETTINGS
@given(cin=st.integers(1, 3), cout=st.integers(1, 3), kh=st.integers(1, 3), kw=st.integers(1, 3),
       stride=st.integers(1, 2), pad=st.integers(0, 1), groups=st.sampled_from([1, 2]),
       hw=st.tuples(st.integers(4, 7), st.integers(4, 7)), **common)
def test_conv2d(monkeypatch, cin, cout, kh, kw, stride, pad, groups, hw, reduction, fused, bias, form, B):
    m = nn.Conv2d(cin * groups, cout * groups, (kh, kw), stride=stride, padding=pad, groups=groups, bias=bias)
    check(m, torch.randn(B, cin * groups, *hw, dtype=torch.float64), reduction, fused, form, monkeypatch)


@pytest.mark.parametrize("mode", ["zeros", "reflect", "circular"])
@pytest.mark.parametrize("cls", [nn.Conv1d, nn.Conv2d])
def test_conv_same_padding_and_padding_modes(cls, mode):
    m = cls(2, 3, 3, padding="same", padding_mode=mode)
    x = torch.randn(3, 2, *([6] if cls is nn.Conv1d else [5, 6]), dtype=torch.float64)
    for fused in (True, False):
        check(m, x, "mean", fused)


@SETTINGS
@given(shape=st.sampled_from([(4,), (3, 4)]), seq=st.sampled_from([(), (1,), (5,), (2, 3)]),
       affine=st.sampled_from(["both", "weight"]), reduction=st.sampled_from(["mean", "sum"]),
       fused=st.booleans(), B=st.integers(2, 5))
def test_layernorm(shape, seq, affine, reduction, fused, B):
    m = nn.LayerNorm(shape, bias=affine == "both")
    with torch.no_grad():                       # move off the init so the weight matters
        m.weight.normal_()
    x = 3 * torch.randn(B, *seq, *shape, dtype=torch.float64) + 1
    check(m, x, reduction, fused)


@SETTINGS
@given(V=st.integers(2, 9), D=st.integers(1, 5), seq=st.sampled_from([(), (1,), (6,), (2, 3)]),
       pad=st.sampled_from([None, 0]), reduction=st.sampled_from(["mean", "sum"]), B=st.integers(2, 5))
def test_embedding(V, D, seq, pad, reduction, B):
    m = nn.Embedding(V, D, padding_idx=pad)
    x = torch.randint(0, V, (B, *seq))           # repeated indices in one example are the hard case
    check(m, x, reduction, fused=True)


class Block(nn.Module):
    """W2-like: Linear D→4D, GELU, Linear 4D→D, LayerNorm, mean over T, Linear D→C; plus an embedding."""

    def __init__(self, V=13, D=6, C=3):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, C)

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(self.ln(self.down(F.gelu(self.up(h)))).mean(1))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 5, 3, padding=1)
        self.fc = nn.Linear(5 * 2 * 2, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        return self.fc(F.max_pool2d(F.relu(self.c2(h)), 2).flatten(1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("which", ["block", "cnn"])
def test_whole_models_norms_and_grads(which, reduction, fused):
    model = (Block() if which == "block" else CNN()).double()
    x = torch.randint(0, 13, (4, 7)) if which == "block" else torch.randn(4, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    ref = func_sq_norms(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y)
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    with PerSampleGradNorms(model, loss_reduction=reduction, fused=fused) as n:
        F.cross_entropy(model(x), y, reduction=reduction).backward()
    torch.testing.assert_close(n.sq_norms(), ref, rtol=1e-6, atol=0)
    for k, p in model.named_parameters():             # .grad is what plain autograd gives
        torch.testing.assert_close(p.grad, plain[k], rtol=1e-10, atol=1e-12, msg=k)
    assert set(n.layer_sq_norms()) == {name for name, m in model.named_modules() if list(m.parameters(False))}
    # forward is restored on exit
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_float32_model_close_to_float64():
    torch.manual_seed(0)
    model = Block()
    x, y = torch.randint(0, 13, (5, 9)), torch.randint(0, 3, (5,))
    ref = func_sq_norms(model.double(), lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y).float()
    model.float()
    with PerSampleGradNorms(model) as n:
        F.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(n.sq_norms(), ref, rtol=1e-4, atol=1e-6)


def test_grad_accumulates_across_backwards():
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    model(x).sum().backward()
    model(x).sum().backward()
    want = model.weight.grad.clone()
    model.zero_grad()
    with PerSampleGradNorms(model, loss_reduction="sum") as n:
        model(x).sum().backward()
        first = n.sq_norms().clone()
        model(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, want)
    torch.testing.assert_close(n.sq_norms(), first)        # norms are of the last backward


def test_frozen_parameters_are_skipped():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    model[0].weight.requires_grad_(False)
    x = torch.randn(5, 3, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum") as n:
        model(x).pow(2).sum().backward()
    assert set(n.param_sq_norms()) == {"0.bias", "1.weight", "1.bias"}
    ref = func_param_sq_norms(model, lambda o, t: (o * 0 + o).pow(2).sum(), x, torch.zeros(5))
    torch.testing.assert_close(n.sq_norms(), sum(ref.values()))


class Scale(nn.Module):
    """A module with a parameter and no rule: not a leaf (a child of its own), so the generic rule, which
    serves leaf modules, does not apply either; nor, switched off, the bare-parameter rule."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(x) * self.weight


def test_unsupported_module_strict_error_names_it_and_nonstrict_reports(monkeypatch):
    monkeypatch.setattr(broadcast_params, "ENABLED", False)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'1'.*Scale.*1\.weight"):
        PerSampleGradNorms(model)
    n = PerSampleGradNorms(model, strict=False)
    assert n.skipped == ["1.weight"]
    with n:
        model(torch.randn(6, 3)).sum().backward()
    assert set(n.layer_sq_norms()) == {"0", "2"}


def test_subclass_with_own_forward_gets_the_generic_rule_not_its_base_classes():
    class Odd(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2
    from elasticlab.gns import rule_for
    from elasticlab.gns.layers import generic
    assert rule_for(Odd(2, 2)).norms is generic.generic_norms
    assert rule_for(nn.Linear(2, 2)).norms is not generic.generic_norms


@pytest.mark.parametrize("fused", [True, False])
def test_parametrized_weight_is_named_and_left_out_on_request(fused, monkeypatch):
    """With the parametrized rule off (gns.layers.parametrized.ENABLED), weight_norm's originals (g, v) get no
    per-example norms (the Linear's rule sees the gradient of the weight they make): strict names the
    parametrization; strict=False leaves them out and keeps the bias's norms exact, fused too (before: a
    KeyError from the fused forward)."""
    from elasticlab.gns.layers import parametrized
    monkeypatch.setattr(parametrized, "ENABLED", False)
    torch.manual_seed(0)
    lin = nn.utils.parametrizations.weight_norm(nn.Linear(4, 3).double())
    model = nn.Sequential(lin)
    with pytest.raises(ValueError, match=r"originals of a parametrization of '0'.s 'weight' \(weight_norm"):
        PerSampleGradNorms(model, fused=fused)
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum", strict=False, fused=fused) as psn:
        model(x).pow(2).sum().backward()
        got = psn.param_sq_norms()
    assert sorted(psn.skipped) == [f"0.parametrizations.weight.original{i}" for i in (0, 1)]
    ref = [torch.autograd.grad(model(x[i:i + 1]).pow(2).sum(), lin.bias)[0].pow(2).sum() for i in range(5)]
    assert list(got) == ["0.bias"]
    torch.testing.assert_close(got["0.bias"], torch.stack(ref), rtol=1e-10, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="'avg'"):
        PerSampleGradNorms(nn.Linear(2, 2), loss_reduction="avg")
    with pytest.raises(ValueError, match="batch dimension"), PerSampleGradNorms(nn.Linear(2, 2)) as n:
        n.model(torch.randn(2))
    with pytest.raises(RuntimeError, match="no per-example norms recorded"):
        PerSampleGradNorms(nn.Linear(2, 2)).sq_norms()


@SETTINGS
@given(nd=st.sampled_from([1, 2]), k=st.integers(1, 3), stride=st.integers(1, 2), dil=st.integers(1, 2),
       pad=st.sampled_from([0, 1, 2, "same"]), mode=st.sampled_from(["zeros", "reflect", "circular"]),
       groups=st.sampled_from([1, 2]))
def test_conv_patches_equal_unfold(nd, k, stride, dil, pad, mode, groups):
    """The single-copy im2col used on CUDA equals F.unfold (transposed), every padding and dilation."""
    from elasticlab.gns.layers.conv import conv_patches, conv_unfold
    if pad == "same":
        stride = 1
    if mode != "zeros" and pad == 2 and k * dil < 3:
        mode = "zeros"                                     # reflect needs padding < input size
    cls = nn.Conv1d if nd == 1 else nn.Conv2d
    m = cls(4, 6, k, stride=stride, padding=pad, dilation=dil, groups=groups, padding_mode=mode)
    x = torch.randn(3, 4, *([11] if nd == 1 else [9, 10]))
    assert torch.equal(conv_patches(m, x), conv_unfold(m, x).transpose(1, 2))


class Wrapper(nn.Module):
    """A module whose loop calls its ``body`` directly, never its own forward (a LightningModule's
    training_step on a submodule)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


@pytest.mark.parametrize("fused", [True, False])
def test_micro_batch_gives_a_fresh_slate_when_the_models_forward_never_runs(fused):
    """Two micro-batches through ``body`` inside one context: after ``micro_batch()`` the norms are the second
    batch's alone (torch.func); outside the context it is refused by name."""
    model = Wrapper()
    x1, x2 = torch.randn(4, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    n = PerSampleGradNorms(model, loss_reduction="sum", fused=fused)
    with pytest.raises(RuntimeError, match=r"micro_batch\(\) outside its context"):
        n.micro_batch()
    assert not n.active
    with n:
        assert n.active
        sq_loss(model.body(x1), 0).backward()
        model.zero_grad()
        n.micro_batch(6)
        sq_loss(model.body(x2), 0).backward()
        got = n.sq_norms()
    ref = func_sq_norms(model.body, sq_loss, x2, torch.zeros(6, 3, dtype=torch.float64))
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    total = float(sum(p.grad.pow(2).sum() for p in model.parameters()))        # the summed loss's: ÷ B²
    assert n.grad_sq_norm() == pytest.approx(total / 6 ** 2, rel=1e-12)


def test_grad_sq_norm_accumulates_in_float64_without_a_float64_copy_of_a_gradient():
    """‖ḡ‖² of a float32 model: each gradient's Σ g² accumulated in float64 by one ``_foreach_norm``, no op
    making a float64 tensor of a gradient's size (before: ``.double().pow(2).sum()``, two float64 copies of
    each gradient); the value that of float64 arithmetic."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.f64 = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    self.f64.append((str(func), t.numel()))
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 5))
    x = torch.randn(8, 64)
    with PerSampleGradNorms(model) as n:
        model(x).pow(2).mean().backward()
        with Sizes() as seen:
            got = n.grad_sq_norm()
    assert seen.f64 and max(k for _, k in seen.f64) <= 4, seen.f64        # 4 parameters: one sum each
    want = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    assert got == pytest.approx(want, rel=1e-13)
