"""Under torch.compile the layers hand their per-example norms out of the compiled backward as the gradient
of a sink (elasticlab.gns.sink), so that a model compiles to one graph, with the norms and gradients of
eager."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elasticlab.gns import GNSEstimator, PerSampleGradNorms
from tests.gns.test_mixed_precision import ConvNet, TinyGPT, mlp_seq, unet3d


class NormNet(nn.Module):
    """Conv2d, GroupNorm, RMSNorm and nn.MultiheadAttention with bias_k/bias_v (two calls into one sink)."""

    def __init__(self, C=8):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(3, C, 3, padding=1), nn.GroupNorm(2, C)
        self.rms = nn.RMSNorm(C)
        self.mha = nn.MultiheadAttention(C, 2, batch_first=True, add_bias_kv=True)
        self.head = nn.Linear(C, 3)

    def forward(self, x):
        h = F.relu(self.gn(self.conv(x))).flatten(2).transpose(1, 2)          # (B, HW, C)
        h = self.rms(h)
        a, _ = self.mha(h, h, h, need_weights=False)
        return self.head(a.mean(1))


class BagNet(nn.Module):
    """EmbeddingBag over (B, L) indices and over the flat indices with offsets, Bilinear, BatchNorm1d in eval
    mode, Conv1d: the remaining rules with fused or hook forms."""

    def __init__(self, V=30, E=6):
        super().__init__()
        self.bag2d, self.bag1d = nn.EmbeddingBag(V, E, mode="mean"), nn.EmbeddingBag(V, E, mode="sum")
        self.bil, self.bn = nn.Bilinear(E, E, 5), nn.BatchNorm1d(5).eval()
        self.conv, self.head = nn.Conv1d(1, 2, 3), nn.Linear(6, 3)

    def forward(self, idx):
        B, L = idx.shape
        flat = self.bag1d(idx.reshape(-1), torch.arange(0, B * L, L, device=idx.device))
        h = self.bn(self.bil(self.bag2d(idx), flat))
        return self.head(self.conv(h.unsqueeze(1)).flatten(1))


class OwnNorm(nn.Module):
    """A leaf of no registered type (as Hugging Face's LlamaRMSNorm), so the generic rule (torch.func)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def generic_mlp():
    return nn.Sequential(nn.Linear(16, 8), OwnNorm(8), nn.GELU(), nn.Linear(8, 4))


def _mean_sq(o):
    return o.pow(2).mean()


def _gpt_loss(o):
    return F.cross_entropy(o.flatten(0, 1), torch.arange(o.numel() // o.shape[-1]) % 40)


CASES = {
    "seq-mlp": (mlp_seq, lambda g: torch.randn(8, 10, 16, generator=g), _mean_sq),
    "conv": (ConvNet, lambda g: torch.randn(6, 3, 8, 8, generator=g), _mean_sq),
    "gpt": (TinyGPT, lambda g: torch.randint(0, 40, (4, 12), generator=g), _gpt_loss),
    "norms-mha": (NormNet, lambda g: torch.randn(5, 3, 4, 4, generator=g), _mean_sq),
    "unet3d": (unet3d, lambda g: torch.randn(6, 2, 4, 3, 2, generator=g), _mean_sq),
    "bags": (BagNet, lambda g: torch.randint(0, 30, (4, 7), generator=g), _mean_sq),
    # (before: a graph break at each generic layer, whose check wrote its cache inside the traced backward)
    "generic": (generic_mlp, lambda g: torch.randn(5, 6, 16, generator=g), _mean_sq),
}


def _steps(model, batches, loss_fn, backend=None, sunk=True):
    """Per step (sq_norms, param_sq_norms, grads) of ``model`` (float64) in one PerSampleGradNorms; compiled
    and ``sunk``, checks that every layer's norms came through the sink."""
    out = []
    run = torch.compile(model, backend=backend) if backend else model
    with PerSampleGradNorms(model, eager_first=False) as n:
        for x in batches:
            model.zero_grad()
            loss_fn(run(x)).backward()
            if backend:             # every layer's norms came through the sink: sq_norms reads it at once
                assert (n._sinks.last is not None) == sunk
            out.append((n.sq_norms(), n.param_sq_norms(),
                        [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_steps_match_eager_in_one_graph(case):
    """Two compiled steps on different batches (a sink's gradient must not carry over) give eager's norms, per
    parameter, and gradients; the model's forward traces to one graph with no break."""
    make, data, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = make().double()
    g = torch.Generator().manual_seed(1)
    batches = [data(g) for _ in range(2)]
    batches = [b.double() if b.is_floating_point() else b for b in batches]
    ref = _steps(model, batches, loss_fn)
    torch._dynamo.reset()
    got = _steps(model, batches, loss_fn, backend="aot_eager")
    for (n, per, grads), (n0, per0, grads0) in zip(got, ref):
        torch.testing.assert_close(n, n0, rtol=1e-10, atol=0)
        assert per.keys() == per0.keys()
        for k in per:
            torch.testing.assert_close(per[k], per0[k], rtol=1e-10, atol=1e-300)
        for a, b in zip(grads, grads0):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with PerSampleGradNorms(model, eager_first=False):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(batches[0])
    reasons = [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


class SeqFirst(nn.Module):
    """Takes (T, B, D): the sinks, sized from the input's dim 0, hold 2·T examples, not B."""

    def __init__(self):
        super().__init__()
        self.lin, self.ln = nn.Linear(4, 6), nn.LayerNorm(6)

    def forward(self, x):
        return self.ln(self.lin(x.transpose(0, 1)))


def test_batch_beyond_the_sinks_falls_back_to_recording():
    """Where a layer's batch exceeds its sink (the model input's dim 0 is not the batch), its backward records
    the norms itself (a graph break): still eager's norms."""
    torch.manual_seed(0)
    model = SeqFirst().double()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2)]     # 2·T=4 < B=5
    ref = _steps(model, batches, _mean_sq)
    torch._dynamo.reset()
    got = _steps(model, batches, _mean_sq, backend="aot_eager", sunk=False)
    for (n, _, grads), (n0, _, grads0) in zip(got, ref):
        assert n.shape == (5,)
        torch.testing.assert_close(n, n0, rtol=1e-10, atol=0)
        for a, b in zip(grads, grads0):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_sinks_follow_the_batch_and_stay_unused_in_eager():
    """The sink is made before the forward for the input's batch, a row per needed parameter, twice as wide
    as the batch (a traced slice never the whole leaf), remade only for a batch as large as it; an eager step
    records the norms directly, leaving it without a gradient."""
    model = mlp_seq()
    with PerSampleGradNorms(model) as n:
        rows = sum(len(s.need) for s in n._slots)
        assert rows == 8                                   # 3 Linears and a LayerNorm, weight and bias each
        model(torch.randn(4, 3, 16)).sum().backward()
        first = n._sinks.leaf
        assert first.shape == (rows, 8) and first.grad is None and first.requires_grad
        model(torch.randn(2, 3, 16)).sum().backward()                       # smaller: kept
        assert n._sinks.leaf is first and n.sq_norms().shape == (2,)
        model(torch.randn(7, 3, 16)).sum().backward()                       # larger, narrower: kept
        assert n._sinks.leaf is first and n.sq_norms().shape == (7,)
        model(torch.randn(8, 3, 16)).sum().backward()                       # as wide: remade
        assert n._sinks.leaf.shape == (rows, 16) and n._sinks.leaf.grad is None
        assert n.sq_norms().shape == (8,)


def test_triton_form_is_one_opaque_operator_when_traced(monkeypatch):
    """A layer the Triton kernel serves (CUDA, half precision) is one call of the operator
    elasticlab_triton::outer_norms in the compiled backward, run with real tensors: here on the CPU with the
    Triton forms stood in for by the float64 reference, counted."""
    from elasticlab.gns import form_choice, kernels, triton_outer, triton_tune
    calls = []

    def stand_in(a, d, with_grad, bias=False):
        calls.append(type(a))
        norms, grad = kernels.seq_linear_outer_norms_ref(a, d, with_grad)
        return (norms, grad, d.sum(1)) if bias else (norms, grad)

    torch.manual_seed(0)
    model = mlp_seq().double()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(8, 10, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    ref = _steps(model, batches, _mean_sq)
    monkeypatch.setattr(triton_outer, "preferred", lambda a, d: True)
    monkeypatch.setattr(triton_tune, "outer_norms", stand_in)
    monkeypatch.setattr(form_choice, "use_gram", lambda *a, **k: False)
    torch._dynamo.reset()
    got = _steps(model, batches, _mean_sq, backend="aot_eager")
    assert calls and set(calls) == {torch.Tensor}          # run with real tensors, never traced into
    assert len(calls) == 3 * 2                             # three sequence Linears a step, two steps
    for (n, _, grads), (n0, _, grads0) in zip(got, ref):
        torch.testing.assert_close(n, n0, rtol=1e-10, atol=0)
        for a, b in zip(grads, grads0):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_batches_of_several_sizes(dynamic):
    """Batches of 8, 5, 11, 6, 7, 3 and 15 examples (the sink, made 16 wide, sliced), then 17 (remade, 34
    wide), static or dynamic shapes, with ``fullgraph=True``: eager's norms at each, and as many graphs as
    the model compiles to without the norms (or fewer) up to 15, one more at 17 (the remade sink's static
    shape).
    Before: a graph at each new batch size, ``dynamic=True`` too (the batch was compared with the sink's
    width and with the model's input batch, and so specialised)."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = TinyGPT().double()
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 40, (b, 12), generator=g) for b in (8, 5, 11, 6, 7, 3, 15, 17)]
    ref = _steps(model, batches, _gpt_loss)
    graphs = []
    for norms in (False, True):
        torch._dynamo.reset()
        counters.clear()
        run = torch.compile(model, backend="aot_eager", dynamic=dynamic, fullgraph=True)   # a break raises
        with PerSampleGradNorms(model) if norms else contextlib.nullcontext() as n:
            for x, (n0, _, _) in zip(batches, ref):
                model.zero_grad()
                _gpt_loss(run(x)).backward()
                if norms:
                    torch.testing.assert_close(n.sq_norms(), n0, rtol=1e-10, atol=0)
                if x.shape[0] == 15:
                    graphs.append(counters["stats"]["unique_graphs"])
        graphs.append(counters["stats"]["unique_graphs"])
    plain, plain_all, normed, normed_all = graphs
    # (normed < plain without dynamic=True: the eager first step's batch already counts as a change of size)
    assert normed <= plain <= 2 and plain_all == plain and normed_all == normed + 1, graphs


def test_importing_elasticlab_leaves_dynamo_unloaded():
    """The eager hooks are wrapped for torch.compile when a context is entered, not at import (importing
    Dynamo takes about a second)."""
    import subprocess
    import sys
    code = "import sys, elasticlab.gns; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_compiled_layer_frozen_after_a_step_records_nothing():
    """A covered layer whose parameters stop training after a compiled step (its sink made) hands nothing
    to its sink in the next (no crash); the others' norms are eager's."""
    torch.manual_seed(0)
    model = mlp_seq().double()
    x = torch.randn(4, 10, 16, dtype=torch.float64)
    frozen = list(model[2].parameters())
    for p in frozen:
        p.requires_grad_(False)
    ref = _steps(model, [x], _mean_sq)[0][1]
    for p in frozen:
        p.requires_grad_(True)
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, strict=False) as n:
        run(x).pow(2).mean().backward()
        assert "2.weight" in n.param_sq_norms()
        for p in frozen:
            p.requires_grad_(False)
        model.zero_grad()
        run(x).pow(2).mean().backward()
        got = n.param_sq_norms()
    assert got.keys() == ref.keys() and not any(k.startswith("2.") for k in got)
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_compiled_bf16_block_one_graph(backend):
    """On CUDA under bf16 autocast, with the Triton form as one opaque operator (wide sequence Linears, 200+
    tiles): a compiled block's norms are eager's (bf16 rounding apart) in one graph, and the tuner ran."""
    from elasticlab.gns import triton_outer, triton_tune
    if not triton_outer.HAS_TRITON:
        pytest.skip("needs Triton")
    torch.manual_seed(0)
    D = 1024
    model = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.LayerNorm(D),
                          nn.Linear(D, 10)).cuda()
    x = torch.randn(4, 128, D, device="cuda")

    def steps(run):
        out = []
        with PerSampleGradNorms(model, eager_first=False) as n:
            for _ in range(2):
                model.zero_grad()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = run(x).float().pow(2).mean()
                loss.backward()
                out.append(n.sq_norms().clone())
        return out

    ref = steps(model)
    torch._dynamo.reset()
    triton_tune.reset()
    got = steps(torch.compile(model, backend=backend, fullgraph=True))
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32
        assert float(((a - b).abs() / b).median()) < 2e-2
    assert triton_tune.tunings()                 # the compiled run's operator tuned the forms afresh


@pytest.mark.parametrize("compiled", [False, True])
def test_an_evaluation_between_backward_and_read_keeps_the_norms(compiled):
    """A forward under no_grad (an evaluation) between a backward and the read of its norms leaves them
    (before: it began a new step, and the readers raised that nothing was recorded); a forward with gradients
    and no backward gives NaN norms, compiled as eagerly, which the estimator skips (before, compiled: that
    error, and the gradient readers raised that no norm was recorded)."""
    torch.manual_seed(0)
    model = mlp_seq().double()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    g = torch.Generator().manual_seed(5)
    x, other = (torch.randn(6, 3, 16, generator=g, dtype=torch.float64) for _ in range(2))
    with PerSampleGradNorms(model) as n:
        for _ in range(2):                         # (the first step eager: eager_first)
            model.zero_grad()
            _mean_sq(run(x)).backward()
            want = n.sq_norms()
            with torch.no_grad():
                run(other)
            torch.testing.assert_close(n.sq_norms(), want, rtol=0, atol=0)
        run(other)
        assert n.sq_norms().isnan().all() and n.sq_norms().shape == (6,)
        est = GNSEstimator()                       # skipped and counted (before, compiled: the grad readers
        assert not est.update_from(n) and est.skipped == 1      # raised that no norm was recorded)
