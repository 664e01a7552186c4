"""PerSampleGradNorms for nn.RNN / nn.LSTM / nn.GRU against per-example gradients of the layers' own (ATen)
forward in float64, with hypothesis shapes: layers, directions, batch_first, bias, initial states, losses on
the outputs, on the final states or on one step only; the output and .grad unchanged; dropout; the errors;
the rule's parameter names taken from the module (register_rule's params as a callable); the loop
references of elasticlab.gns.reference."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from elasticlab.gns import RULES, PerSampleGradNorms, covered_params, register_rule, rule_for
from elasticlab.gns.reference import (
    example_param_sq_norms,
    func_param_sq_norms,
    func_sq_norms,
    loop_param_sq_norms,
    loop_sq_norms,
)

CELLS = {"rnn_tanh": lambda **k: nn.RNN(nonlinearity="tanh", **k), "rnn_relu": lambda **k: nn.RNN(
    nonlinearity="relu", **k), "lstm": nn.LSTM, "gru": nn.GRU}


def loss_of(out, h, which, batch_first):
    h = h[0] if isinstance(h, tuple) else h
    if which == "output":
        return out.pow(2).sum()
    if which == "final":
        return h.pow(2).sum() + h.sum()
    return out.select(1 if batch_first else 0, 0).sum()                # the first step only


def run(m, x, hx, which):
    out, h = m(x, hx) if hx is not None else m(x)
    return out, h, loss_of(out, h, which, m.batch_first)


@settings(max_examples=30, deadline=None)
@given(cell=st.sampled_from(list(CELLS)), layers=st.integers(1, 2), bi=st.booleans(),
       batch_first=st.booleans(), bias=st.booleans(), with_hx=st.booleans(),
       which=st.sampled_from(["output", "final", "first"]), B=st.integers(1, 3), T=st.integers(1, 5),
       reduction=st.sampled_from(["mean", "sum"]), data=st.data())
def test_against_the_layers_own_forward(cell, layers, bi, batch_first, bias, with_hx, which, B, T, reduction,
                                       data):
    torch.manual_seed(data.draw(st.integers(0, 99)))
    m = CELLS[cell](input_size=3, hidden_size=4, num_layers=layers, bidirectional=bi, batch_first=batch_first,
                    bias=bias).double()
    x = torch.randn(B, T, 3, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    L = layers * (2 if bi else 1)
    hx = None
    if with_hx:
        hx = torch.randn(L, B, 4, dtype=torch.float64)
        hx = (hx, torch.randn(L, B, 4, dtype=torch.float64)) if cell == "lstm" else hx

    def example_loss(b):                                     # the reference: one example at a time
        xb = x[b:b + 1] if batch_first else x[:, b:b + 1]
        hb = None if hx is None else (tuple(h[:, b:b + 1] for h in hx) if cell == "lstm" else hx[:, b:b + 1])
        return run(m, xb, hb, which)[2]
    want = example_param_sq_norms(m, (example_loss(b) for b in range(B)))
    out0, h0, loss0 = run(m, x, hx, which)
    m.zero_grad()
    (loss0 / (B if reduction == "mean" else 1)).backward()
    plain = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    with PerSampleGradNorms(m, loss_reduction=reduction) as n:
        out, h, loss = run(m, x, hx, which)
        (loss / (B if reduction == "mean" else 1)).backward()
    torch.testing.assert_close(out, out0, rtol=1e-10, atol=1e-12)
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, plain[k], rtol=1e-9, atol=1e-12, msg=k)
    got = n.param_sq_norms()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-8, atol=1e-12, msg=k)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_dropout_between_layers_with_one_example(cell):
    """In training with dropout the masks are this forward's own: with one example the per-example norm is
    the squared norm of .grad, whatever mask was drawn."""
    torch.manual_seed(0)
    m = CELLS[cell](input_size=3, hidden_size=4, num_layers=3, dropout=0.5).double().train()
    with PerSampleGradNorms(m, loss_reduction="sum") as n:
        out, _ = m(torch.randn(6, 1, 3, dtype=torch.float64))
        out.pow(2).sum().backward()
    got = n.param_sq_norms()
    for k, p in m.named_parameters():
        torch.testing.assert_close(got[k], p.grad.pow(2).sum().reshape(1), rtol=1e-10, atol=1e-14, msg=k)


def test_errors():
    lstm = nn.LSTM(3, 4)
    with PerSampleGradNorms(lstm):
        with pytest.raises(ValueError, match="need a batch dimension: LSTM got an input of shape \\(5, 3\\)"):
            lstm(torch.randn(5, 3))
        packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3), [5, 3])
        with pytest.raises(ValueError, match="do not support PackedSequence"):
            lstm(packed)
    with pytest.raises(ValueError, match="weight_hr_l0"):
        PerSampleGradNorms(nn.LSTM(3, 4, proj_size=2))


def test_the_rule_covers_the_layers_own_parameters():
    """The rule's names come from the module (any depth): exactly its parameters, without proj_size's."""
    for m in (nn.GRU(3, 4, num_layers=3, bidirectional=True), nn.LSTM(3, 4, num_layers=2, bias=False),
              nn.RNN(3, 4)):
        assert covered_params(rule_for(m), m) == tuple(k for k, _ in m.named_parameters())
    lstm = nn.LSTM(3, 4, proj_size=2, bidirectional=True)
    assert set(dict(lstm.named_parameters())) - set(covered_params(rule_for(lstm), lstm)) == {
        "weight_hr_l0", "weight_hr_l0_reverse"}


def test_register_rule_takes_a_tuple_or_a_callable_for_params():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))

        def forward(self, x):
            return x * self.a * self.b

    for bad in ("a", 3, None, ("a", 3)):
        with pytest.raises(ValueError, match="Two: params must be a tuple of parameter names or a callable"):
            register_rule(Two, lambda *args: {}, params=bad)
    assert Two not in RULES
    try:
        rule = register_rule(Two, lambda *args: {}, params=lambda m: ("a",))
        assert covered_params(rule, Two()) == ("a",)
        with pytest.raises(ValueError, match=r"of type Two \(parameters \['b'\]\)"):
            PerSampleGradNorms(Two())
        assert covered_params(register_rule(Two, lambda *args: {}, params=["a", "b"]), Two()) == ("a", "b")
        PerSampleGradNorms(Two())
    finally:
        RULES.pop(Two, None)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_in_a_language_model_with_autocast(cell):
    """An embedding, a 2-layer LSTM (GRU: its candidate gate's δh̃ = δi ⊙ r) and a head under bf16 autocast:
    norms in float32, near the fp32 ones."""
    torch.manual_seed(0)
    emb, lstm, head = nn.Embedding(30, 8), CELLS[cell](input_size=8, hidden_size=16, num_layers=2,
                                                      batch_first=True), nn.Linear(16, 30)
    model = nn.ModuleDict({"emb": emb, "lstm": lstm, "head": head})
    idx = torch.randint(0, 30, (6, 10))
    norms = {}
    for dt in (None, torch.bfloat16):
        model.zero_grad()
        with PerSampleGradNorms(model, loss_reduction="sum") as n:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dt is not None):
                logits = head(lstm(emb(idx))[0])
            F.cross_entropy(logits.float().flatten(0, 1), idx.flatten(), reduction="sum").backward()
        norms[dt] = n.param_sq_norms()
    assert len(norms[None]) == 1 + 8 + 2
    for k, ref in norms[None].items():
        got = norms[torch.bfloat16][k]
        assert got.dtype == torch.float32
        assert ((got - ref).abs() / ref).median() < 0.05, k


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_compiled_equals_eager_in_one_graph(cell):
    """torch.compile (aot_eager) of a language model holding a 2-layer bidirectional recurrent layer: with
    Dynamo's allow_rnn (off by default: Dynamo then runs nn.RNN/LSTM/GRU eagerly, a graph break, and eager
    norms follow), one graph and no break; the norms leave the compiled backward through the sink and equal
    eager's, per parameter, on two batches."""
    torch.manual_seed(0)
    emb, rnn, head = nn.Embedding(20, 3), CELLS[cell](input_size=3, hidden_size=4, num_layers=2,
                                                    batch_first=True, bidirectional=True), nn.Linear(8, 20)
    model = nn.Sequential(emb, rnn, Pick(), head).double()
    batches = [torch.randint(0, 20, (4, 5)), torch.randint(0, 20, (4, 5))]

    def loss_of(run, idx):
        return F.cross_entropy(run(idx).flatten(0, 1), idx.flatten())
    with torch._dynamo.config.patch(allow_rnn=True):
        with PerSampleGradNorms(model, eager_first=False) as n:
            explained = torch._dynamo.explain(model)(batches[0])
            compiled = torch.compile(model, backend="aot_eager")
            for idx in batches:
                got = []
                for run_it in (model, compiled):
                    model.zero_grad()
                    loss_of(run_it, idx).backward()
                    got.append((n.sq_norms(), n.param_sq_norms(), n._sinks.read() is not None))
                assert not got[0][2] and got[1][2]          # eager records; compiled: all from the sink
                torch.testing.assert_close(got[1][0], got[0][0], rtol=1e-10, atol=0)
                for k, v in got[0][1].items():
                    torch.testing.assert_close(got[1][1][k], v, rtol=1e-10, atol=0, msg=k)
    torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


class Pick(nn.Module):
    """A recurrent layer's output sequence, without its final state."""

    def forward(self, out):
        return out[0]


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_relu"])
def test_frozen_input_weights_on_an_input_without_gradient(cell):
    """W_ih (and b_ih) frozen on the first layer, whose input needs no gradient: the input-side
    pre-activations need none either, yet W_hh's and b_hh's norms still come from them (float64)."""
    torch.manual_seed(1)
    m = CELLS[cell](input_size=3, hidden_size=4, num_layers=2).double()
    m.weight_ih_l0.requires_grad_(False)
    m.bias_ih_l0.requires_grad_(False)
    x = torch.randn(6, 3, 3, dtype=torch.float64)                       # (T, B, F)
    want = example_param_sq_norms(m, (m(x[:, b:b + 1])[0].pow(2).sum() for b in range(3)))
    with PerSampleGradNorms(m, loss_reduction="sum") as n:
        m(x)[0].pow(2).sum().backward()
    got = n.param_sq_norms()
    assert set(got) == set(want) and "weight_hh_l0" in got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-14, msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cuda_matches_the_cpu(cell):
    """The loop on CUDA (the plain layer's forward there is cuDNN's) against the CPU, float64."""
    torch.manual_seed(0)
    cpu = CELLS[cell](input_size=3, hidden_size=8, num_layers=2, bidirectional=True).double()
    cuda = CELLS[cell](input_size=3, hidden_size=8, num_layers=2, bidirectional=True).double().cuda()
    cuda.load_state_dict(cpu.state_dict())
    x = torch.randn(7, 5, 3, dtype=torch.float64)
    norms = []
    for m, dev in ((cpu, "cpu"), (cuda, "cuda")):
        with PerSampleGradNorms(m) as n:
            m(x.to(dev))[0].pow(2).sum().backward()
        norms.append(n.param_sq_norms())
    for k, want in norms[0].items():
        torch.testing.assert_close(norms[1][k].cpu(), want, rtol=1e-9, atol=1e-14, msg=k)


def test_loop_reference_equals_torch_func_and_psgn():
    """reference.loop_sq_norms (the benchmark's check where vmap cannot batch nn.LSTM) and its per-parameter
    loop_param_sq_norms against torch.func on a model vmap handles, and against PerSampleGradNorms on an
    LSTM."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)

    def sq(o, t):
        return (o - t).pow(2).sum()
    torch.testing.assert_close(loop_sq_norms(mlp, sq, x, y), func_sq_norms(mlp, sq, x, y), rtol=1e-12, atol=0)
    per, ref = loop_param_sq_norms(mlp, sq, x, y), func_param_sq_norms(mlp, sq, x, y)
    assert list(per) == list(ref)
    for k in ref:
        torch.testing.assert_close(per[k], ref[k], rtol=1e-12, atol=0, msg=k)
    lstm = nn.LSTM(3, 4, batch_first=True).double()
    xs, ys = torch.randn(4, 5, 3, dtype=torch.float64), torch.randn(4, 5, 4, dtype=torch.float64)
    want = loop_sq_norms(lstm, lambda o, t: sq(o[0], t), xs, ys)
    with PerSampleGradNorms(lstm, loss_reduction="sum") as n:
        sq(lstm(xs)[0], ys).backward()
    torch.testing.assert_close(n.sq_norms(), want, rtol=1e-10, atol=0)
    per = loop_param_sq_norms(lstm, lambda o, t: sq(o[0], t), xs, ys)
    for k, v in n.param_sq_norms().items():
        torch.testing.assert_close(v, per[k], rtol=1e-10, atol=0, msg=k)
