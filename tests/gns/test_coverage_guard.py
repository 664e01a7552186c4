"""The coverage guard of PerSampleGradNorms (issue 16, item 5): a covered parameter that the loss depends on
while its module never ran is an error naming the module (strict) or left out with a warning; MHA with a
frozen in-projection still gets exact norms (its rule calls out_proj). Ground truth: torch.func, float64."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import RULES, PerSampleGradNorms, kernels
from elasticlab.gns.layers import broadcast_params
from elasticlab.gns.reference import func_param_sq_norms, func_sq_norms, loop_param_sq_norms

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def sq_loss(out, y):
    """ℓ_i = ‖out_i − y_i‖², summed over the batch."""
    return (out - y).pow(2).sum()


class Attn(nn.Module):
    """Self-attention (in-projection frozen below) then a Linear head on the mean over the sequence."""

    def __init__(self, E=8, H=2, out=3):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=True)
        self.head = nn.Linear(E, out)

    def forward(self, x):
        return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))


class Direct(nn.Module):
    """``lin``'s parameters used through F.linear, never by calling ``lin`` (unless ``call``)."""

    def __init__(self, D=6, out=3):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, out)
        self.unused = nn.Linear(D, D)          # trainable, never used: must not be reported
        self.call = False

    def forward(self, x):
        h = self.lin(x) if self.call else F.linear(x, self.lin.weight, self.lin.bias)
        return self.head(torch.tanh(h))


def frozen_in_proj_attn():
    torch.manual_seed(0)
    m = Attn().double()
    m.mha.in_proj_weight.requires_grad_(False)
    m.mha.in_proj_bias.requires_grad_(False)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    return m, x, torch.randn(4, 3, dtype=torch.float64)


def run(model, x, y, reduction="mean", **kw):
    div = x.shape[0] if reduction == "mean" else 1
    model.zero_grad()
    with PerSampleGradNorms(model, loss_reduction=reduction, **kw) as n:
        (sq_loss(model(x), y) / div).backward()
    return n


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mha_with_frozen_in_proj_has_exact_norms(fused, reduction):
    m, x, y = frozen_in_proj_attn()
    ref = func_param_sq_norms(m, sq_loss, x, y)
    assert set(ref) == {"mha.out_proj.weight", "mha.out_proj.bias", "head.weight", "head.bias"}
    n = run(m, x, y, reduction, fused=fused)
    got = n.param_sq_norms()
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-8, atol=1e-12, msg=k)
    torch.testing.assert_close(n.sq_norms(), func_sq_norms(m, sq_loss, x, y), rtol=1e-8, atol=1e-12)
    assert n.left_out == []


def test_mha_without_its_rule_is_a_strict_error_naming_out_proj(monkeypatch):
    """The guard itself on the case of the issue: with no MHA rule, out_proj's weight is used by
    F.multi_head_attention_forward without calling out_proj."""
    monkeypatch.delitem(RULES, nn.MultiheadAttention)
    m, x, y = frozen_in_proj_attn()
    n = run(m, x, y)
    with pytest.raises(RuntimeError, match=r"'mha\.out_proj' \(NonDynamicallyQuantizableLinear\) never ran"):
        n.sq_norms()
    with pytest.raises(RuntimeError, match=r"mha\.out_proj\.weight"):
        n.grad_sq_norm()


@pytest.mark.parametrize("fused", [True, False])
def test_parameter_used_without_calling_its_module_is_a_strict_error(fused):
    torch.manual_seed(0)
    m = Direct().double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    n = run(m, x, y, fused=fused)
    assert n.left_out == ["lin.bias", "lin.weight"]
    for read in (n.sq_norms, n.param_sq_norms, n.layer_sq_norms, n.grad_sq_norm):
        with pytest.raises(RuntimeError, match=r"\['lin\.bias', 'lin\.weight'\].*'lin' \(Linear\) never ran"):
            read()


def test_parameter_used_without_calling_its_module_nonstrict_is_left_out_with_one_warning():
    torch.manual_seed(0)
    m = Direct().double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ref = func_param_sq_norms(m, sq_loss, x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = run(m, x, y, reduction="sum", strict=False)
        got = n.param_sq_norms()
        n.sq_norms()
        g2 = n.grad_sq_norm()
        n.layer_grad_sq_norms()
    ours = [w for w in caught if "left out" in str(w.message)]
    assert len(ours) == 1 and "lin.weight" in str(ours[0].message)
    assert issubclass(ours[0].category, RuntimeWarning)
    assert n.left_out == ["lin.bias", "lin.weight"]
    assert set(got) == {"head.weight", "head.bias"}
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-8, atol=1e-12, msg=k)
    # ‖ḡ‖² over the same parameters as the per-example norms (the head's), mean gradient of a summed loss
    B = x.shape[0]
    want = (m.head.weight.grad.pow(2).sum() + m.head.bias.grad.pow(2).sum()).item() / B ** 2
    assert g2 == pytest.approx(want, rel=1e-12)
    assert m.lin.weight.grad is not None and m.lin.weight.grad.abs().sum() > 0


def test_guard_resets_each_step_and_a_called_module_is_covered():
    """Step 1 uses lin's weight directly (error), step 2 calls lin: exact norms, nothing left out; the probe
    hooks of step 1 are gone after the context."""
    torch.manual_seed(0)
    m = Direct().double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    with PerSampleGradNorms(m, loss_reduction="sum") as n:
        sq_loss(m(x), y).backward()
        with pytest.raises(RuntimeError, match="never ran"):
            n.sq_norms()
        m.call = True
        m.zero_grad()
        sq_loss(m(x), y).backward()
        assert n.left_out == []
        got = n.sq_norms()
    torch.testing.assert_close(got, func_sq_norms(m, sq_loss, x, y), rtol=1e-8, atol=1e-12)
    assert not m.lin.weight._post_accumulate_grad_hooks


def test_parameter_used_after_the_forward_is_caught():
    """A covered module's weight used by the loss outside the model's forward (after it returned)."""
    torch.manual_seed(0)
    m = Direct().double()
    m.call = True
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    with PerSampleGradNorms(m) as n:
        m(x)
        h = F.linear(x, m.unused.weight)
        sq_loss(h, y).backward()
    with pytest.raises(RuntimeError, match=r"'unused' \(Linear\) never ran"):
        n.sq_norms()


class Scale2(nn.Module):
    """out = x · a · b, two parameters of one module."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return x * self.a * self.b


def test_a_rule_that_misses_a_parameter_it_covers_is_an_error_naming_it(monkeypatch):
    """A module that ran, whose rule covers ``a`` and ``b`` but records only ``a``'s norms: the readers of
    ‖ḡ‖² raise naming ``b`` (the norms would leave out part of the gradient, biasing the GNS); with
    strict=False they leave it out too, with a warning; frozen, no error; nor is a covered parameter whose
    gradient is zero (the module's output unused, gradients zeroed in place)."""
    def norms_of_a_only(module, inputs, g, need):
        return {"a": (inputs[0] * module.b * g).pow(2).sum(1)}
    monkeypatch.setitem(RULES, Scale2, RULES.get(Scale2))
    from elasticlab.gns import register_rule
    register_rule(Scale2, norms_of_a_only, params=("a", "b"))
    torch.manual_seed(0)
    m = nn.Sequential(Scale2(), nn.Linear(3, 2))
    x = torch.randn(4, 3)
    with PerSampleGradNorms(m, fused=False) as n:
        m(x).pow(2).sum().backward()                     # the first step: b's .grad is probed
        for read in (n.param_sq_norms, n.grad_sq_norm):
            with pytest.raises(RuntimeError, match=r"\['0\.b'\], and '0' \(Scale2\) ran, but no per-example"):
                read()
        m.zero_grad()
        m(x).pow(2).sum().backward()                     # later steps: the readers of ‖ḡ‖² find it
        assert set(n.param_sq_norms()) == {"0.a", "1.weight", "1.bias"}
        want = r"no per-example norm of \['0\.b'\] was recorded, though the gradient is nonzero: module '0' "
        for read in (n.grad_sq_norm, n.layer_grad_sq_norms):
            with pytest.raises(RuntimeError, match=want + r"\(Scale2\) ran"):
                read()
    m[0].b.requires_grad_(False)
    m.zero_grad()
    with PerSampleGradNorms(m, fused=False) as n:
        m(x).pow(2).sum().backward()
        assert n.grad_sq_norm() > 0
    m[0].b.requires_grad_(True)

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.s, self.head = Scale2(), nn.Linear(3, 2)

        def forward(self, x):
            self.s(x)                                        # runs, its output reaches no loss
            return self.head(x)
    u = Unused()
    for p in u.parameters():
        p.grad = torch.zeros_like(p)
    with PerSampleGradNorms(u, fused=False) as n:
        u(x).pow(2).sum().backward()
        assert n.grad_sq_norm() > 0                          # s.a, s.b: zero gradients, no norms, no error



class TiedLM(nn.Module):
    """GPT-2's tying: the token embedding's table is the output layer's weight (one Parameter, two modules);
    ``pool``: the head on the mean over positions (2-D inputs)."""

    def __init__(self, V=11, E=4, bias=True, padding_idx=None, pool=False):
        super().__init__()
        self.tok, self.mix = nn.Embedding(V, E, padding_idx=padding_idx), nn.Linear(E, E)
        self.head, self.pool = nn.Linear(E, V, bias=bias), pool
        self.head.weight = self.tok.weight

    def forward(self, idx):
        h = torch.tanh(self.mix(self.tok(idx)))
        return self.head(h.mean(1) if self.pool else h)


def lm_loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"padding_idx": 0}, {"pool": True}])
def test_tied_embedding_and_output_layer_give_exact_norms(kw, fused):
    """The table's per-example gradient is the embedding's part plus the output layer's: its norm has their
    cross term (gns.tied), which the two rules alone would miss (before: their norms summed, silently)."""
    torch.manual_seed(0)
    model = TiedLM(**kw).double()
    idx = torch.randint(0, 11, (4, 5))
    idx[0, :2] = 0
    y = torch.randint(0, 11, (4,) if kw.get("pool") else (4, 5))
    ref = func_param_sq_norms(model, lm_loss, idx, y)
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused) as n:
        lm_loss(model(idx), y).backward()
        got, layers = n.param_sq_norms(), n.layer_sq_norms()
        assert set(got) == set(ref)                       # the table once, under the embedding's name
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(layers["tok"], ref["tok.weight"], rtol=1e-9, atol=1e-12)
        assert ("head" in layers) == (kw.get("bias", True))           # the output layer: its bias alone
        total = sum(float(p.grad.pow(2).sum()) for p in model.parameters())
        assert n.grad_sq_norm() == pytest.approx(total / 4 ** 2, rel=1e-12)


class TiedSeq2Seq(nn.Module):
    """T5's tying: a ``shared`` table that never runs itself, the same Parameter as the encoder's and the
    decoder's embeddings (and, ``head_tied``, the output layer's weight). The input is (B, 2, T): source and
    target rows."""

    def __init__(self, V=11, E=4, head_tied=True, padding_idx=None):
        super().__init__()
        self.shared = nn.Embedding(V, E, padding_idx=padding_idx)
        self.enc_emb = nn.Embedding(V, E, padding_idx=padding_idx)
        self.dec_emb = nn.Embedding(V, E, padding_idx=padding_idx)
        self.enc_emb.weight = self.dec_emb.weight = self.shared.weight
        self.mix, self.head = nn.Linear(E, E), nn.Linear(E, V, bias=False)
        if head_tied:
            self.head.weight = self.shared.weight

    def forward(self, x):
        h = torch.tanh(self.mix(self.enc_emb(x[:, 0]))).mean(1, keepdim=True)
        return self.head(torch.tanh(self.dec_emb(x[:, 1]) + h))


@pytest.mark.parametrize("kw", [{}, {"head_tied": False}, {"padding_idx": 0}])
def test_a_table_shared_by_several_embeddings_and_the_output_layer(kw):
    """The table's per-example gradient sums the encoder's and decoder's embedding parts and the output
    layer's; its norm is kept by the first of the embeddings, ``shared``, which never runs (before: "parameter
    'shared.weight' is also 'enc_emb.weight', ... (tied weights)")."""
    torch.manual_seed(0)
    model = TiedSeq2Seq(**kw).double()
    x = torch.randint(0, 11, (4, 2, 5))
    x[0, :, :2] = 0
    y = torch.randint(0, 11, (4, 5))
    ref = func_param_sq_norms(model, lm_loss, x, y)
    with PerSampleGradNorms(model, loss_reduction="sum") as n:
        for _ in range(2):
            model.zero_grad()
            lm_loss(model(x), y).backward()
            got = n.param_sq_norms()
            assert set(got) == set(ref)
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12, msg=k)
            assert "enc_emb" not in n.layer_sq_norms()


class ScaledEmbedding(nn.Embedding):
    """Gemma's and BART's scaled word embedding: the lookup times a constant (Vaswani et al. 2017 §3.4)."""

    def forward(self, idx):
        return super().forward(idx) * 2.5


class OffsetEmbedding(nn.Embedding):
    """BART's positional embedding's kind: a forward of its own that is not a scaling of the lookup."""

    def forward(self, idx):
        return super().forward((idx + 2) % self.num_embeddings)


@pytest.mark.parametrize("kind", [ScaledEmbedding, OffsetEmbedding])
@pytest.mark.parametrize("tied", [False, True])
def test_embedding_subclasses_with_a_forward_of_their_own(kind, tied, monkeypatch):
    """A scaled lookup takes the embedding rule at c·δ (tied to the output layer too: Gemma's default); any
    other forward the generic rule (before: the generic rule for both, B per-example tables at once, and a
    tie of either refused)."""
    from elasticlab.gns.layers import embedding, generic
    torch.manual_seed(0)
    model = TiedLM().double()
    model.tok = kind(11, 4).double()
    model.head.weight = model.tok.weight if tied else nn.Parameter(model.head.weight.detach().clone())
    idx, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    ref = func_param_sq_norms(model, lm_loss, idx, y)
    called, real = [], generic.generic_norms
    monkeypatch.setattr(generic, "generic_norms", lambda *a: called.append(1) or real(*a))
    if tied and kind is OffsetEmbedding:
        with PerSampleGradNorms(model, loss_reduction="sum") as n:
            with pytest.raises(RuntimeError, match=r"tied weights .*OffsetEmbedding.* not a scaled lookup"):
                lm_loss(model(idx), y).backward()
        return
    with PerSampleGradNorms(model, loss_reduction="sum") as n:
        lm_loss(model(idx), y).backward()
        got = n.param_sq_norms()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12, msg=k)
    assert embedding.scale_of(model.tok, idx) == (2.5 if kind is ScaledEmbedding else None)
    assert bool(called) == (kind is OffsetEmbedding)


def test_other_shared_parameters_are_refused_or_left_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    model.double()
    with pytest.raises(ValueError, match=r"parameter '0\.weight' is also '2\.weight' \(tied weights\)"):
        PerSampleGradNorms(model)
    ref = func_param_sq_norms(model, sq_loss, x, y)
    with PerSampleGradNorms(model, loss_reduction="sum", strict=False) as n:
        assert n.skipped == ["0.weight", "2.weight"]
        sq_loss(model(x), y).backward()
        got = n.param_sq_norms()
    assert set(got) == {"0.bias", "2.bias"}
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("pad", [None, 0])
def test_tied_weights_under_compile_match_eager(pad):
    """Under torch.compile the tied modules' hooks run eagerly (a graph break at each; before: an error), so
    the table's norm over two compiled steps is eager's, and the rest of the model still compiles."""
    import torch._dynamo
    torch.manual_seed(0)
    model = TiedLM(padding_idx=pad).double()
    xs = [torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    ys = [torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(9 + i)) for i in range(2)]
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager")
    for x, y in zip(xs, ys):
        ref = func_param_sq_norms(model, lm_loss, x, y)
        with PerSampleGradNorms(model, eager_first=False, loss_reduction="sum") as n:
            model.zero_grad()
            lm_loss(run(x), y).backward()
            got = n.param_sq_norms()
        assert set(got) == set(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12, msg=k)
    with PerSampleGradNorms(model, eager_first=False):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(xs[0])
    assert explained.graph_count >= 1
    assert all("disable" in r.reason for r in explained.break_reasons), explained.break_reasons


def test_tied_output_layer_alone_when_the_embedding_does_not_run():
    """Embeddings passed in (the table used by the output layer only): its norm is the output layer's."""
    class FromEmbeds(TiedLM):
        def forward(self, x):
            return self.head(torch.tanh(self.mix(x)))

    torch.manual_seed(0)
    model = FromEmbeds().double()
    x, y = torch.randn(4, 5, 4, dtype=torch.float64), torch.randint(0, 11, (4, 5))
    ref = func_param_sq_norms(model, lm_loss, x, y)
    for _ in range(2):                                    # (no state left from the step before)
        with PerSampleGradNorms(model, loss_reduction="sum") as n:
            model.zero_grad()
            lm_loss(model(x), y).backward()
            got = n.param_sq_norms()
        assert set(got) == set(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-12)


def test_tied_norms_under_bf16_autocast_are_close_to_fp32():
    torch.manual_seed(0)
    model = TiedLM(V=50, E=16)
    idx, y = torch.randint(0, 50, (8, 12)), torch.randint(0, 50, (8, 12))
    out = {}
    for on in (False, True):
        with PerSampleGradNorms(model, loss_reduction="sum") as n:
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
                logits = model(idx)
            lm_loss(logits.float(), y).backward()
            out[on] = n.param_sq_norms()["tok.weight"]
    assert out[True].dtype == torch.float32
    assert float(((out[True] - out[False]).abs() / out[False]).median()) < 0.02



def test_tied_output_layer_after_the_embedding_in_the_backward_is_an_error():
    """The output layer on an input that does not come from the embedding, and run before it: autograd runs
    the later node first, the embedding's, when the table's norm could no longer take the output layer's part
    (before: the norm of the embedding's part alone, silently)."""
    class Apart(TiedLM):
        def forward(self, idx):
            h = self.head(torch.tanh(self.mix(torch.ones(*idx.shape, 4))))
            return h.sum(-1) + self.tok(idx).sum(-1)

    model = Apart()
    with PerSampleGradNorms(model, loss_reduction="sum"):
        out = model(torch.randint(0, 11, (4, 5)))
        with pytest.raises(RuntimeError, match=r"output layer's backward ran after the embedding's"):
            out.sum().backward()


def _gradual():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model[0].requires_grad_(False)                           # the first stage of gradual unfreezing
    return model


def test_parameter_unfrozen_after_construction_is_refused_or_left_out():
    """Parameters frozen when PerSampleGradNorms was made and trained later (gradual unfreezing) have no
    slot: their norms were silently missing. Now the readers raise naming them (strict), or warn and leave
    them out of the norms and of grad_sq_norm alike."""
    model = _gradual()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        sq_loss(model(x), y).backward()
        psn.sq_norms()                                       # frozen still: fine
        model[0].requires_grad_(True)
        model.zero_grad()
        sq_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match=r"\['0.weight', '0.bias'\] were frozen when PerSampleGrad"):
            psn.sq_norms()
    model = _gradual()
    with PerSampleGradNorms(model, loss_reduction="sum", strict=False) as psn:
        model[0].requires_grad_(True)
        sq_loss(model(x), y).backward()
        with pytest.warns(RuntimeWarning, match="were frozen when PerSampleGradNorms was made"):
            got = psn.sq_norms()
        g2 = psn.grad_sq_norm()
    ref = func_param_sq_norms(model, sq_loss, x, y)
    torch.testing.assert_close(got, ref["2.weight"] + ref["2.bias"], rtol=1e-10, atol=0)
    want = sum(float(model[2].get_parameter(n).grad.pow(2).sum()) for n in ("weight", "bias")) / 36
    assert abs(g2 - want) < 1e-12 * want


def test_monitor_follows_gradual_unfreezing_with_a_new_estimate():
    """GNSMonitor made with the first layer frozen (its per-example norms and gradients set up for the rest):
    when the layer trains, the next step warns, follows the new parameter set and restarts the estimate
    (EMAs of another parameter set's noise do not mix), with the per-example norms now over all layers."""
    from elasticlab.gns import GNSEstimator, GNSMonitor
    model = _gradual()
    mon = GNSMonitor(model, beta=0.5)
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64))
            for _ in range(3)]
    for x, y in data[:2]:
        with mon.step():
            F.mse_loss(model(x), y).backward()
        model.zero_grad()
    assert mon.estimator.num_updates == 2 and set(mon.layer_b_simple()) == {"2"}
    model[0].requires_grad_(True)
    x, y = data[2]
    with pytest.warns(RuntimeWarning, match=r"\['0.weight', '0.bias'\] train now.*estimate restarted"):
        with mon.step():
            F.mse_loss(model(x), y).backward()
    assert mon.estimator.num_updates == 1 and set(mon.layer_b_simple()) == {"0", "2"}
    ref = GNSEstimator(beta=0.5)                 # the same step folded by hand, over every parameter
    sq = func_sq_norms(model, lambda o, t: F.mse_loss(o, t, reduction="sum") / 3, x, y)
    g2 = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    ref.update(sq, g2)
    for a, b in ((mon.grad_sq, ref.grad_sq), (mon.trace_cov, ref.trace_cov)):
        assert abs(a - b) < 1e-8 * abs(b), (a, b)


@pytest.mark.parametrize("frozen", [0, 2])
def test_parameter_frozen_after_construction_is_refused_or_left_out(frozen):
    """The other way (progressive freezing): parameters that trained when PerSampleGradNorms was made and are
    frozen later. The first layer's rows were silently NaN (its backward no longer runs), a middle one's
    counted; now the readers raise naming them (strict), or warn and leave them out."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    names = f"\\['{frozen}.weight', '{frozen}.bias'\\]"
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        model[frozen].requires_grad_(False)
        sq_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match=names + " trained when PerSampleGradNorms was made and are "
                           "frozen now"):
            psn.sq_norms()
    model[frozen].requires_grad_(True)
    with PerSampleGradNorms(model, loss_reduction="sum", strict=False) as psn:
        model[frozen].requires_grad_(False)
        model.zero_grad()
        sq_loss(model(x), y).backward()
        with pytest.warns(RuntimeWarning, match=names + " trained when PerSampleGradNorms was made"):
            got = psn.sq_norms()
        per = psn.param_sq_norms()
    ref = func_param_sq_norms(model, sq_loss, x, y)
    assert set(per) == set(ref) and not any(k.startswith(f"{frozen}.") for k in per)
    torch.testing.assert_close(got, sum(ref.values()), rtol=1e-10, atol=0)


def test_monitor_follows_freezing_with_a_new_estimate():
    """GNSMonitor made with every layer training, then the first frozen: the next step warns, follows the
    new parameter set and restarts the estimate (before: a RuntimeError from a tensor hook, and every later
    step 'begin() called twice'); its estimate is that of the remaining layers."""
    from elasticlab.gns import GNSEstimator, GNSMonitor
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    mon = GNSMonitor(model, beta=0.5)
    data = [(torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64))
            for _ in range(2)]
    with mon.step():
        F.mse_loss(model(data[0][0]), data[0][1]).backward()
    model.zero_grad()
    model[0].requires_grad_(False)
    x, y = data[1]
    with pytest.warns(RuntimeWarning, match=r"\['0.weight', '0.bias'\] are frozen now.*estimate restarted"):
        with mon.step():
            F.mse_loss(model(x), y).backward()
    assert mon.estimator.num_updates == 1 and set(mon.layer_b_simple()) == {"2"}
    ref = GNSEstimator(beta=0.5)
    sq = func_sq_norms(model, lambda o, t: F.mse_loss(o, t, reduction="sum") / 3, x, y)
    ref.update(sq, sum(float(p.grad.double().pow(2).sum()) for p in model[2].parameters()))
    for a, b in ((mon.grad_sq, ref.grad_sq), (mon.trace_cov, ref.trace_cov)):
        assert abs(a - b) < 1e-8 * abs(b), (a, b)
    with pytest.raises(ValueError, match="batch_size"):     # a failed begin leaves no step open
        with mon.step(batch_size=0):
            pass
    with mon.step():
        F.mse_loss(model(x), y).backward()
    assert mon.estimator.num_updates == 2


def test_a_parents_alias_of_a_covered_parameter_is_not_uncovered(monkeypatch):
    """``self.bias = self.decoder.bias`` (Hugging Face's masked-LM heads): the parent's direct parameter is
    the Linear's, covered there and counted once; a parameter of the parent's own is not an alias (refused
    where the bare-parameter rule, gns.layers.broadcast_params, is off)."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.Linear(4, 3).double()
            self.bias = self.decoder.bias

        def forward(self, x):
            return self.decoder(x)

    torch.manual_seed(0)
    model, x = Head(), torch.randn(5, 4, dtype=torch.float64)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        model(x).pow(2).sum().backward()
        got = psn.param_sq_norms()
    assert sorted(got) == ["decoder.bias", "decoder.weight"] and psn.skipped == []
    torch.testing.assert_close(got["decoder.bias"], (2 * model(x)).pow(2).sum(1).detach(), rtol=1e-10, atol=0)
    model.scale = nn.Parameter(torch.ones(()))
    monkeypatch.setattr(broadcast_params, "ENABLED", False)
    with pytest.raises(ValueError, match=r"module '\(root\)' of type Head \(parameters \['scale'\]\)"):
        PerSampleGradNorms(model)


class InPlaceOnView(nn.Module):
    """A Linear on (B, T, D) (F.linear's output a view of its 2-D product), then changed in place: ``how``."""

    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(3, 4), nn.Linear(4, 2), how

    def forward(self, x):
        h = self.a(x)
        self.how(h)
        return self.b(torch.tanh(h)).mean(1)


def _scale_a_view(h):
    v = h.reshape(h.shape[0], -1)[:, :6]
    v *= 0.5


@pytest.mark.parametrize("fused", ["C++", "Python", False])
@pytest.mark.parametrize("how", [_scale_a_view, lambda h: h.add_(1.0), lambda h: h[:, 0].mul_(2.0)],
                         ids=["view-of-view", "itself", "slice"])
def test_in_place_ops_on_a_sequence_linears_output(fused, how, monkeypatch):
    """An in-place op on a sequence Linear's output or on a view of it: fused (the C++ autograd function, or
    the Python one without the kernels), before, PyTorch refused it ("a view created inside a custom
    Function"); hooks, its gradient went past the hook on the output (an error naming 'a'). The output is
    now a tensor of its own: norms equal one backward per example."""
    if fused == "Python":
        monkeypatch.setattr(kernels, "USE_KERNELS", False)
    fused = bool(fused)
    torch.manual_seed(0)
    m, x = InPlaceOnView(how).double(), torch.randn(5, 3, 3, dtype=torch.float64)
    with PerSampleGradNorms(m, loss_reduction="sum", fused=fused) as n:
        m(x).pow(2).sum().backward()
        got = n.param_sq_norms()
    want = loop_param_sq_norms(m, lambda out, y: out.pow(2).sum(), x, x)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-12)
