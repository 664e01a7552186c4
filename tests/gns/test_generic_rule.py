"""The fallback rule for leaf modules of no registered type (elasticlab.gns.layers.generic): per-example
gradients by torch.func, against torch.func over the whole model in float64 (hypothesis shapes), fused
neighbours and hooks; modules that mix examples or draw random numbers refused by name; chunked; bf16
autocast; torch.compile."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from elasticlab.gns import PerSampleGradNorms, rule_for
from elasticlab.gns.layers import broadcast_params, generic
from elasticlab.gns.reference import example_param_sq_norms, func_param_sq_norms

SETTINGS = settings(max_examples=10, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


class HFStyleRMSNorm(nn.Module):
    """As Hugging Face's LlamaRMSNorm: its own class, not nn.RMSNorm, so no registered rule."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + self.eps))


class ScaleShift(nn.Module):
    """Two parameters of a leaf module (a LayerScale with a shift), one broadcast from (1, D)."""

    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(d))
        self.beta = nn.Parameter(torch.randn(1, d))

    def forward(self, x):
        return torch.tanh(x * self.gamma + self.beta)


class DoubleLinear(nn.Linear):
    """A subclass of a registered type with a forward of its own: the registered rule does not apply."""

    def forward(self, x):
        return 2 * super().forward(x) + self.weight.sum()


class MixesExamples(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return (x - x.mean(0)) * self.weight


class Noisy(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return F.dropout(x, 0.5) * self.weight


def model_with(layer, d_in=3, d=6):
    return nn.Sequential(nn.Linear(d_in, d), layer, nn.Linear(d, 2)).double()


def check_exact(model, x, fused):
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as psn:
        model(x).pow(2).sum().backward()
        got = psn.param_sq_norms()
    ref = func_param_sq_norms(model, lambda o, y: o.pow(2).sum(), x, torch.zeros(x.shape[0]))
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-14, msg=k)


@SETTINGS
@given(B=st.integers(1, 6), T=st.integers(1, 5), d=st.integers(1, 7), fused=st.booleans(),
       layer=st.sampled_from(["rms", "scaleshift", "double"]))
def test_generic_rule_matches_torch_func(B, T, d, fused, layer):
    torch.manual_seed(B * 100 + T * 10 + d)
    mod = {"rms": lambda: HFStyleRMSNorm(d), "scaleshift": lambda: ScaleShift(d),
           "double": lambda: DoubleLinear(d, d)}[layer]()
    assert rule_for(mod).norms is generic.generic_norms
    check_exact(model_with(mod, d=d), torch.randn(B, T, 3, dtype=torch.float64), fused)


def test_generic_rule_on_2d_inputs_and_in_chunks(monkeypatch):
    torch.manual_seed(1)
    model = model_with(ScaleShift(6))
    x = torch.randn(7, 3, dtype=torch.float64)
    check_exact(model, x, True)
    monkeypatch.setattr(generic, "CHUNK_BYTES", 1)        # one example at a time: same norms
    check_exact(model, x, True)


@pytest.mark.parametrize("layer, why", [(MixesExamples, "depends on the other examples"),
                                        (Noisy, "does not run on one example at a time")])
def test_modules_the_generic_rule_cannot_serve_are_named(layer, why):
    model = model_with(layer(6))
    with PerSampleGradNorms(model) as psn:
        with pytest.raises(RuntimeError, match=f"{layer.__name__} has no per-example gradient-norm .*{why}"):
            model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    del psn


def test_switched_off_the_module_is_uncovered_again(monkeypatch):
    monkeypatch.setattr(generic, "ENABLED", False)
    model = model_with(MixesExamples(6))
    with pytest.raises(ValueError, match=r"no per-example gradient-norm rule for module '1' of type Mix"):
        PerSampleGradNorms(model)
    assert PerSampleGradNorms(model, strict=False).skipped == ["1.weight"]


def test_non_leaf_module_with_its_own_parameter_takes_the_broadcast_rule(monkeypatch):
    """A module with children and a parameter of its own: the generic rule would run the children's rules
    again inside it, so it does not apply; its gain, broadcast over the batch, is followed to that broadcast
    (gns.layers.broadcast_params), and is refused where that rule is off."""

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.g = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return self.lin(x) * self.g

    torch.manual_seed(0)
    model = nn.Sequential(Gate()).double()
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        model(x).pow(2).sum().backward()
        got = psn.param_sq_norms()["0.g"]
    want = torch.stack([torch.autograd.grad(model(x[b:b + 1]).pow(2).sum(), model[0].g)[0].pow(2).sum()
                        for b in range(5)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    monkeypatch.setattr(broadcast_params, "ENABLED", False)
    with pytest.raises(ValueError, match=r"module '0' of type Gate \(parameters \['0.g'\]\)"):
        PerSampleGradNorms(model)


def test_bf16_autocast_norms_near_fp32():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(16, 32), HFStyleRMSNorm(32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 10, 16)
    out = {}
    for ac in (False, True):
        with PerSampleGradNorms(model) as psn, torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
            out[ac] = psn.param_sq_norms()["1.weight"]
    assert out[True].dtype == torch.float32
    rel = ((out[True] - out[False]).abs() / out[False]).median()
    assert rel < 0.02, rel


class ArgmaxRouter(nn.Module):
    """A router with a bare weight (no rule of its own): the logit it picks, times 1 + the pick, so that
    which of its two experts wins shows in the norms. Its logits for x = (1, 1e-3) are 1 and 1.001: float32
    picks the second; bf16 rounds both to 1, and argmax takes the first."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([[1.0, 0.0], [1.0, 1.0]]))

    def forward(self, x):
        logits = F.linear(x, self.weight)
        pick = logits.argmax(-1, keepdim=True)
        return logits.gather(-1, pick).squeeze(-1) * (1 + pick.squeeze(-1))


class TwiceRouted(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = ArgmaxRouter()

    def forward(self, x):
        return self.router(x) + self.router(2 * x)


@pytest.mark.parametrize("twice", [False, True])
def test_under_autocast_the_forward_runs_again_as_it_ran(twice):
    """The generic rule runs the module's forward again in the backward, where autocast is off: it runs
    it under the call's own autocast state, so that a router's bf16 logits pick the experts they picked
    (before, float32 picked others: DeepSeek-V3's router gate was 5% off under bf16, against 0.02% now).
    Against one backward per example through the same autocast forward; called twice, the calls' sum."""
    model = TwiceRouted() if twice else ArgmaxRouter()
    x = torch.ones(4, 3, 2)
    x[..., 1] = 1e-3 * torch.linspace(0.5, 1.0, 12).view(4, 3)
    want = {}
    for ac in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
            out = model(x)
        want[ac] = sum(example_param_sq_norms(model, (out[b].float().sum() for b in range(4))).values())
    assert (want[False] > 3 * want[True]).all()               # float32 and bf16 picked other experts
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
        got = psn.sq_norms()
    torch.testing.assert_close(got, want[True].float(), rtol=1e-2, atol=0)


def test_compiled_model_with_a_generic_layer_matches_eager():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 6), HFStyleRMSNorm(6), nn.Linear(6, 2))
    x = torch.randn(5, 4, 3)
    with PerSampleGradNorms(model) as psn:
        model(x).pow(2).mean().backward()
        want = psn.sq_norms()
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model) as psn:
        for _ in range(2):
            model.zero_grad()
            compiled(x).pow(2).mean().backward()
            torch.testing.assert_close(psn.sq_norms(), want, rtol=1e-5, atol=0)


def test_compiled_before_any_eager_step_is_one_graph():
    """A generic layer met first under torch.compile (no eager step has checked it): its check runs inside
    the traced backward without a side effect, so the model is one graph with no break (before: a break at
    each generic layer, whose check wrote its cache there: 12 breaks in a 2-layer Llama), and the norms are
    eager's; a module that mixes the examples gives NaN norms there instead of an error."""
    import torch._dynamo
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 6), HFStyleRMSNorm(6), nn.Linear(6, 2)).double()
    x = torch.randn(5, 4, 3, dtype=torch.float64)
    torch._dynamo.reset()
    with PerSampleGradNorms(model, eager_first=False):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert explained.graph_count == 1
    generic._checked.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, eager_first=False) as psn:
        compiled(x).pow(2).mean().backward()
        got = psn.param_sq_norms()
    want = func_param_sq_norms(model, lambda out, y: (out - y).pow(2).sum(), x, torch.zeros(5, 4, 2,
                                                                                        dtype=torch.float64))
    for k in want:                        # (the mean over 5·4·2 outputs: each example's loss is its sum / 8)
        torch.testing.assert_close(got[k], want[k] / 8**2, rtol=1e-8, atol=1e-30, msg=k)


def test_compiled_module_mixing_examples_gives_nan():
    class Centre(nn.Module):                    # subtracts the batch mean: not per example
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.g * (x - x.mean(0, keepdim=True))

    import torch._dynamo
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Centre(), nn.Linear(4, 2))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, eager_first=False) as psn:
        compiled(torch.randn(6, 3)).pow(2).sum().backward()
        got = psn.param_sq_norms()
    assert got["1.g"].isnan().all() and got["0.weight"].isfinite().all()
    with PerSampleGradNorms(model), pytest.raises(RuntimeError, match="depends on the other examples"):
        model(torch.randn(6, 3)).pow(2).sum().backward()


class OwnLinear(nn.Linear):
    """A Linear with a forward of its own (Falcon's FalconLinear): the generic rule."""

    def forward(self, x):
        return x @ self.weight.T


class SumInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = OwnLinear(4, 4, bias=False), OwnLinear(4, 4, bias=False)

    def forward(self, x):
        y = self.a(x)
        y += self.b(x)                  # (Falcon: mlp_output += attention_output)
        return y


def test_compiled_in_place_op_on_a_generic_layers_output():
    """Under torch.compile a generic layer's output comes through the tap, which is not a view of it for
    autograd: an in-place op on it traces (before: "Output 0 of ApplyTemplate is a view and is being
    modified inplace"), with eager's norms."""
    import torch._dynamo
    torch.manual_seed(0)
    model = SumInPlace().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with PerSampleGradNorms(model) as psn:
        model(x).pow(2).sum().backward()
        want = psn.param_sq_norms()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model) as psn:
        model.zero_grad()
        compiled(x).pow(2).sum().backward()
        got = psn.param_sq_norms()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=0, msg=k)


class TableBias(nn.Module):
    """A leaf with a bare table, called on no tensor (Swin's relative position bias): (1, T, D)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 4))

    def forward(self):
        return self.table.unsqueeze(0)


class WithTableBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bias = nn.Linear(4, 4), TableBias()

    def forward(self, x):
        return self.lin(x) + self.bias()


def test_compiled_call_without_the_batch_is_named():
    """Such a call under torch.compile is refused naming it and the way out (before: "expected a tensor
    input", or the generic rule's "none of its inputs has the batch"); eager follows it to its broadcast."""
    import torch._dynamo
    torch.manual_seed(0)
    model = WithTableBias()
    x = torch.randn(3, 5, 4)
    with PerSampleGradNorms(model, eager_first=False) as psn:
        model(x).pow(2).sum().backward()
        assert psn.param_sq_norms()["bias.table"].shape == (3,)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, eager_first=False) as psn:
        compiled(x).pow(2).sum().backward()
        with pytest.raises(RuntimeError, match=r"module 'bias' \(TableBias\) ran without the batch .* under "
                                               r"torch.compile"):
            psn.param_sq_norms()


@pytest.mark.parametrize("reentrant", [True, False])
def test_generic_rule_under_checkpointing(reentrant):
    """The generic rule runs the module's forward itself (torch.func's vjp); PerSampleGradNorms' hooks stay
    out of that call (slot.Quiet). Before, under reentrant checkpointing it was counted as a call of the
    step and its vmapped output escaped ("your tensor may have escaped from inside a function being
    vmapped")."""
    from torch.utils.checkpoint import checkpoint

    class Scaled(nn.Module):
        def __init__(self, mode):
            super().__init__()
            self.mode = mode
            self.scale = ScaleShift(8)
            self.head = nn.Linear(8, 3)

        def body(self, x):
            return torch.tanh(self.scale(x))

        def forward(self, x):
            h = self.body(x) if self.mode is None else checkpoint(self.body, x, use_reentrant=self.mode)
            return self.head(h)

    torch.manual_seed(0)
    plain, model = Scaled(None).double(), Scaled(reentrant).double()
    model.load_state_dict(plain.state_dict())
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 3, (5,))

    def loss_fn(out, t):
        return F.cross_entropy(out, t, reduction="sum")
    ref = func_param_sq_norms(plain, loss_fn, x.detach(), y)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        for _ in range(2):
            model.zero_grad()
            loss_fn(model(x), y).backward()
            got = psn.param_sq_norms()
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=0, msg=k)


class GatedByKeyword(nn.Module):
    """A leaf reading a per-example tensor passed by keyword (as Whisper's positional embedding reads its
    positions): forward(x, *, gate)."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x, *, gate):
        return x * self.w * gate


@pytest.mark.parametrize("fused", [True, False])
def test_generic_rule_sees_keyword_arguments(fused):
    """(before: the hook saw positional arguments only; each example's forward ran without the keyword: a
    TypeError)"""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(3, 6), GatedByKeyword(6), nn.Linear(6, 2)

        def forward(self, x):
            h = self.inp(x)
            return self.out(self.mid(h, gate=torch.sigmoid(x[:, :1]) + 1))

    check_exact(Net().double(), torch.randn(5, 3, dtype=torch.float64), fused)


def test_a_call_with_no_batched_input_is_named():
    """A leaf of no registered type whose output carries the batch but none of whose inputs does (it
    broadcasts a learned vector itself): an error naming it, not vmap's "expected at least one Tensor"."""
    class Broadcasts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(1, 3))

        def forward(self, z, n):
            return (z * self.w).expand(n, 3)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gen, self.head = Broadcasts(), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(x[:, :3] + self.gen(torch.ones(1, 3, dtype=x.dtype), x.shape[0]))

    model = Net().double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        with pytest.raises(RuntimeError, match=r"Broadcasts has no per-example gradient-norm rule.*none of "
                                               "its inputs has the batch"):
            model(torch.randn(4, 5, dtype=torch.float64)).sum().backward()
            psg.param_sq_norms()
