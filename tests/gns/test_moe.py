"""A mixture of experts (Shazeer et al. 2017; Fedus et al. 2022, eq. 1; Hugging Face's Mixtral in small): a
router (a leaf module on the tokens folded to (B·T, D), returning logits, weights and indices: the generic
rule with its rows read per example and a tuple output) and experts whose (E, out, in) weights are used by
F.linear, expert by expert, on the tokens routed to each (rows gathered from the examples' positions,
``folds.row_examples``, taken per example by ``Step.through``). Against one backward per example in
float64 (before: the experts' weights were refused by name, and the router's norms were never formed)."""
import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F
from layer_check import against_per_example, eager_then_compiled, on_device
from torch import nn

from elasticlab.gns import PerSampleGradNorms, folds
from elasticlab.gns.layers import generic, row_grams

_spec = importlib.util.spec_from_file_location(
    "bench_moe", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py")
bench_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_moe)
Experts, GroupedExperts = bench_moe.Experts, bench_moe.GroupedExperts    # (the benchmark's experts, tested)


class Router(nn.Module):
    def __init__(self, D, E, k):
        super().__init__()
        self.weight, self.k = nn.Parameter(torch.randn(E, D) / D ** 0.5), k

    def forward(self, h):
        logits = F.linear(h.reshape(-1, h.shape[-1]), self.weight)
        top, idx = torch.topk(logits.softmax(-1), self.k, dim=-1)
        top /= top.sum(-1, keepdim=True)
        return logits, top, idx


class MoE(nn.Module):
    """Embedding Linear, then the sparse block on (B·T, D) with a residual, then a head; ``flat``: the block
    takes the tokens of a (B, D) input (no positions: the gather's source rows are the examples)."""

    def __init__(self, D=4, H=3, E=4, k=2, flat=False):
        super().__init__()
        self.inp, self.gate, self.experts = nn.Linear(3, D), Router(D, E, k), Experts(D, H, E)
        self.head, self.flat = nn.Linear(D, 2), flat

    def forward(self, x):
        h = self.inp(x)
        rows = h.reshape(-1, h.shape[-1])
        _, w, idx = self.gate(rows)
        rows = rows + self.experts(rows, idx, w)
        return self.head(torch.tanh(rows.reshape(h.shape)) if self.flat else
                         torch.tanh(rows.reshape(h.shape)).mean(1))


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def _by_example(m, batch, s):
    return _loss(m(batch[0][s]), batch[1][s])


def _check(model, x, y, fused):
    return against_per_example(model, lambda s: _loss(model(x[s]), y[s]), x.shape[0], fused=fused,
                               loss_reduction="sum", complete=True)[0]


@pytest.fixture(params=["gram", "gram-loop", "products"])
def form(request, monkeypatch):
    """The experts' norms by the Gram form over each example's rows (batched over the examples padded, or
    an example at a time), or by forming each example's G_b."""
    monkeypatch.setattr(row_grams, "FORM", request.param.split("-")[0])
    if request.param == "gram-loop":
        monkeypatch.setattr(row_grams, "PAD_LIMIT", 0)
    return request.param


@pytest.mark.parametrize("pad_limit", [4, 0, 1000])
def test_row_grams_of_uses_against_each_examples_gradient(pad_limit, monkeypatch):
    """Three uses of one weight with uneven rows per example (one example has none in a use, one has most of
    a use's rows): the norms of Σ_u G_b^u after each use, against G_b = D_bᵀX_b formed; padded and batched,
    an example at a time, and mixed (``pad_limit`` 4: the lopsided use alone is looped)."""
    monkeypatch.setattr(row_grams, "PAD_LIMIT", pad_limit)
    g = torch.Generator().manual_seed(0)
    B, din, dout = 6, 5, 3
    grams, total = row_grams.RowGrams(B), torch.zeros(B, dout, din, dtype=torch.float64)
    for counts in ([2, 0, 3, 1, 0, 1], [1] * B, [0, 30, 1, 0, 0, 0]):
        X = torch.randn(sum(counts), din, dtype=torch.float64, generator=g)
        D = torch.randn(sum(counts), dout, dtype=torch.float64, generator=g)
        use = row_grams.RowsUse(X, D, counts)
        assert (use.padded is None) == (B * max(counts) > pad_limit * sum(counts))
        assert use.padded is None or counts[1] < 30 or pad_limit > 4
        got, s = grams.add(use), 0
        for b, c in enumerate(counts):
            total[b] += D[s:s + c].t() @ X[s:s + c]
            s += c
        torch.testing.assert_close(got, total.pow(2).sum((1, 2)), rtol=1e-12, atol=1e-12)


def test_by_example_sorts_stably_and_counts_on_the_host():
    order, counts = row_grams.by_example(torch.tensor([2, 0, 2, 1, 0]), 4)
    assert order.tolist() == [1, 4, 3, 0, 2] and counts == [2, 1, 2, 0]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shape", [(5, 7, 4, 2), (3, 1, 4, 1), (2, 6, 8, 2), (4, 4, 4, 2)],
                         ids=["B5T7E4k2", "T1", "E8", "T=B"])
def test_moe_norms_match_per_example_backward(fused, shape, form):
    """Experts some examples' tokens never reach (E8 on 12 tokens), one token per example (T1), top-1, as
    many positions as examples (T=B: the fold's layout read past the (B, B, D) view)."""
    B, T, E, k = shape
    torch.manual_seed(0)
    model = MoE(E=E, k=k).double()
    x, y = torch.randn(B, T, 3, dtype=torch.float64), torch.randint(0, 2, (B,))
    _check(model, x, y, fused)
    # the real gradients are untouched
    ref = MoE(E=E, k=k).double()
    ref.load_state_dict(model.state_dict())
    _loss(ref(x), y).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)


def test_moe_on_rows_that_are_the_examples():
    """Tokens gathered from a (B, D) batch: the gather's source rows are the examples themselves."""
    torch.manual_seed(1)
    _check(MoE(flat=True).double(), torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,)), True)


def test_row_examples_reads_the_gather():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, requires_grad=True)
    rows = x.reshape(-1, 2)
    idx = torch.tensor([11, 0, 5, 4])
    assert folds.row_examples(rows[idx], 3).tolist() == [2, 0, 1, 1]
    t = x.transpose(0, 1).reshape(-1, 2)                           # (T, B) rows: j·B + b
    assert folds.row_examples(t.index_select(0, idx) * 2, 3).tolist() == [2, 0, 2, 1]
    assert folds.row_examples(torch.randn(4, 2, requires_grad=True), 3) is None     # no graph to read
    sq = torch.randn(3, 3, 2, requires_grad=True).reshape(-1, 2)   # (B, B) of a leaf: not read
    assert folds.row_examples(sq[idx[1:]], 3) is None


def test_a_router_that_mixes_the_examples_is_refused():
    """The generic rule reads a folded call per example only where that gives the rows of the call on the
    batch: a router normalising over all tokens mixes the examples, an error naming it."""
    class Mixing(Router):
        def forward(self, h):
            logits, top, idx = super().forward(h)
            return logits, top * (1 + top.mean(0)), idx                # (a mean over all tokens)

    torch.manual_seed(0)
    model = MoE().double()
    model.gate = Mixing(4, 4, 2).double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        with pytest.raises(RuntimeError, match=r"Mixing has no per-example gradient-norm rule.*depends on "
                                               "the other examples"):
            _loss(model(torch.randn(3, 5, 3, dtype=torch.float64)), torch.randint(0, 2, (3,))).backward()
            psg.param_sq_norms()


def test_a_tuple_output_of_the_examples():
    """A leaf module of no registered type on (B, D) returning two outputs, both reaching the loss, one
    not: the generic rule gets their gradients together."""
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x @ self.a, torch.tanh(x @ self.a) * self.b.sum(), (x * 2).sum(1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.two, self.head = Two(), nn.Linear(4, 2)

        def forward(self, x):
            u, v, _ = self.two(x)
            return self.head(u * v)

    torch.manual_seed(0)
    _check(Net().double(), torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,)), True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_moe_on_the_device(device, form):
    """In float32 on the device against float64 on the CPU (not under autocast: bf16 may route tokens to
    other experts than float64 does, so the two are not the same function)."""
    torch.manual_seed(3)
    x, y = torch.randn(16, 7, 3, dtype=torch.float64), torch.randint(0, 2, (16,))
    on_device(MoE(), x, y, _loss, device, False)


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_experts_match_per_example_backward(fused):
    """Each group's rows, sorted by example, are a use of the slice gate_up[e] in the Gram form (float32: the
    CPU's grouped_mm takes no float64; to float32's rounding)."""
    torch.manual_seed(0)
    model = MoE(D=8, H=4, E=4)
    model.experts = GroupedExperts(8, 4, 4)
    model.inp, model.head = nn.Linear(3, 8), nn.Linear(8, 2)
    model.gate = Router(8, 4, 2)
    x, y = torch.randn(4, 6, 3), torch.randint(0, 2, (4,))
    psg = against_per_example(model, lambda s: _loss(model(x[s]), y[s]), 4, rtol=2e-4, atol=1e-9,
                              fused=fused, loss_reduction="sum")[0]
    step = next(s for s in psg._slots if s.name == "experts").follow
    assert len(step.parts[id(step.slot), "gate_up"]) > 1                  # (a use of each expert's slice)


def test_other_grouped_forms_are_refused_with_the_way_out():
    """A grouped matmul of 3-D operands (one batch of rows per group) is not read per example: the error names
    the weight and the eager loop of F.linear that is."""
    class Grouped3D(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.act = nn.Parameter(torch.randn(2, 8, 4)), nn.Identity()

        def forward(self, h):
            return self.act(F.grouped_mm(h.reshape(2, -1, 8), self.w).reshape(-1, 4))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.experts, self.head = nn.Linear(3, 8), Grouped3D(), nn.Linear(4, 2)

        def forward(self, x):
            h = self.inp(x)
            return self.head(self.experts(h.reshape(-1, 8)).reshape(*h.shape[:2], 4).mean(1))

    model = Net()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        model(torch.randn(4, 6, 3)).sum().backward()
        with pytest.raises(RuntimeError,
                           match=r"'experts\.w' .* torch._grouped_mm .*set_experts_implementation"):
            psg.param_sq_norms()


def test_each_experts_weight_is_held_as_its_slice(form):
    """gate_up_proj[e] is held as (B, out, in), not mapped back to the whole (B, E, out, in): the step keeps a
    part per expert used, and the norm is their sum. An expert applied twice in a step (a second pass) sums
    its two per-example gradients before the norm (exact against one backward per example)."""
    class Twice(Experts):
        def forward(self, h, idx, w):
            return super().forward(super().forward(h, idx, w) + h, idx, w)

    torch.manual_seed(2)
    model = MoE(E=3).double()
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    psg = _check(model, x, y, True)
    step = next(s for s in psg._slots if s.name == "experts").follow
    assert sorted(step.parts[id(step.slot), "gate_up"]) == sorted({int(e) for e in model.gate(
        model.inp(x).reshape(-1, 4))[2].unique()})
    assert step.acc == {} and step.grams == {}             # let go at the step's last use
    twice = MoE(E=3).double()
    twice.experts = Twice(4, 3, 3).double()
    _check(twice, x, y, True)


def test_a_weight_used_whole_and_by_slices_is_named():
    class Both(Experts):
        def forward(self, h, idx, w):
            return super().forward(h, idx, w) + 0.1 * F.linear(h, self.down.sum(0).t()).sum(-1, keepdim=True)

    torch.manual_seed(0)
    model = MoE().double()
    model.experts = Both(4, 3, 4).double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        _loss(model(torch.randn(3, 5, 3, dtype=torch.float64)), torch.randint(0, 2, (3,))).backward()
        with pytest.raises(RuntimeError, match=r"'experts\.down' is used in one step both whole and by its "
                                               "slices"):
            psg.param_sq_norms()



def test_rows_of_two_gathers_that_disagree_are_not_read():
    x = torch.randn(2, 3, 2, requires_grad=True)
    rows = x.reshape(-1, 2)
    a, b = rows[torch.tensor([0, 4])], rows[torch.tensor([1, 5])]
    assert folds.row_examples(a + a, 2).tolist() == [0, 1]
    assert folds.row_examples(a + b, 2).tolist() == [0, 1]                 # (the same examples)
    assert folds.row_examples(a + rows[torch.tensor([5, 0])], 2) is None   # a row of each: mixed


class LeafExperts(nn.Module):
    """Experts with no child module (GPT-OSS's): the generic rule, whose forward vmap cannot run (a loop
    over the experts present, ``torch.where`` on the routing), so the examples are taken one at a time,
    each on its own tokens."""

    def __init__(self, D, H, E):
        super().__init__()
        self.up = nn.Parameter(torch.randn(E, D, H) / D ** 0.5)
        self.down = nn.Parameter(torch.randn(E, H, D) / H ** 0.5)

    def forward(self, h, idx, w):
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            tok, pos = torch.where(idx == e)
            y = torch.tanh(h[tok] @ self.up[e]) @ self.down[e] * w[tok, pos, None]
            out = out.index_add(0, tok, y)
        return out


class SequenceRouter(Router):
    """Called on (B, T, D), its logits on the B·T tokens (DeepSeek-V3's): only the output folds."""

    def forward(self, h):
        return super().forward(h)


class LeafMoE(MoE):
    def __init__(self, E=4, k=2):
        super().__init__(E=E, k=k)
        self.experts, self.gate = LeafExperts(4, 3, E), SequenceRouter(4, E, k)

    def forward(self, x):
        h = self.inp(x)
        _, w, idx = self.gate(h)
        rows = h.reshape(-1, h.shape[-1])
        return self.head(torch.tanh((rows + self.experts(rows, idx, w)).reshape(h.shape)).mean(1))


@pytest.mark.parametrize("fused", [True, False])
def test_leaf_experts_by_a_loop_over_the_examples(fused):
    torch.manual_seed(4)
    model = LeafMoE().double()
    _check(model, torch.randn(4, 6, 3, dtype=torch.float64), torch.randint(0, 2, (4,)), fused)
    assert list(generic._checked[model.experts].values()) == [True]         # (taken by the loop)
    assert list(generic._checked[model.gate].values()) == [False]           # (vmap: only its output folds)


def test_random_ops_are_still_refused_not_looped():
    """The loop is for data-dependent control flow only: a forward that draws random numbers (a router's
    jitter) stays an error naming the module."""
    class Jitter(Router):
        def forward(self, h):
            return super().forward(h * torch.empty_like(h).uniform_(0.9, 1.1))

    torch.manual_seed(0)
    model = MoE().double()
    model.gate = Jitter(4, 4, 2).double()
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        with pytest.raises(RuntimeError, match=r"Jitter has no per-example gradient-norm rule.*random"):
            _loss(model(torch.randn(3, 5, 3, dtype=torch.float64)), torch.randint(0, 2, (3,))).backward()
            psg.param_sq_norms()


def test_a_tuple_output_under_compile_matches_eager():
    """Under torch.compile a router's tuple output is joined eagerly (its hook skipped by Dynamo: a graph
    break at the router; before: the readers raised naming it): two compiled steps, no eager one, give one
    backward per example's norms, the router's included."""
    torch.manual_seed(0)
    model = MoE().double()
    batches = [(torch.randn(3, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(i)),
                torch.randint(0, 2, (3,), generator=torch.Generator().manual_seed(i + 2))) for i in (1, 2)]
    eager_then_compiled(model, _by_example, (), batches, loss_reduction="sum")


def test_a_folded_input_whose_layout_is_not_read_is_refused_not_given_per_row(monkeypatch):
    """Where the layout of the router's folded input cannot be read (compile's eager parts, nothing learned,
    ``folds.find`` made to miss), its norms are one per row (15 for 3 examples): every reader refuses them
    by name (before: ``param_sq_norms`` and ``layer_sq_norms`` returned the 15 rows as if examples)."""
    torch.manual_seed(0)
    model = MoE().double()
    x, y = torch.randn(3, 5, 3, dtype=torch.float64), torch.tensor([0, 1, 1])
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager")
    monkeypatch.setattr(folds, "find", lambda x, batch: None)
    try:
        with PerSampleGradNorms(model, loss_reduction="sum") as psg:
            _loss(run(x), y).backward()
            for read in (psg.param_sq_norms, psg.layer_sq_norms, psg.sq_norms):
                with pytest.raises(RuntimeError, match=r"most say 3, but \{'gate': 15\}.*one step eager"):
                    read()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("grouped", [False, True])
def test_bench_moe_runs_and_its_model_is_exact(grouped):
    """benchmarks/bench_moe.py at a tiny size, its experts by F.linear or by grouped_mm: every method runs
    and reports; its model's norms (fused) equal one backward per example."""
    import json
    import os
    import subprocess
    import sys
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "bench_moe.py")
    out = subprocess.run([sys.executable, bench, "--batch", "3", "--seq", "4", "--dim", "8", "--hidden", "8",
                          "--experts", "3", "--rounds", "1", "--steps", "1", "--threads", "1",
                          *(["--grouped"] if grouped else [])],
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert set(got["ratio"]) == {"plain", "psgn", "psgn-hooks", "psgn-products", "loop"}
    assert got["ratio"]["plain"] == 1.0
    if grouped:                            # (the CPU's grouped_mm takes no float64: the bench's run stands)
        return
    torch.manual_seed(0)
    _check(bench_moe.MoE(8, 6, 3, 2, 2).double(), torch.randn(3, 4, 8, dtype=torch.float64),
           torch.randint(0, 10, (3,)), True)


def test_an_expert_given_as_many_tokens_as_examples(form):
    """An expert routed exactly B tokens (and one routed all B·T): its input's dim 0 equals a batch size by
    chance, and is still read as gathered rows (before: taken as the batch, then refused)."""
    class Fixed(nn.Module):
        def forward(self, h):
            R = h.shape[0]                             # (rows b·T + t: each example's first token)
            idx = torch.where(torch.arange(R) % 5 == 0, 0, 1)[:, None]
            return None, torch.ones(R, 2, dtype=h.dtype), torch.cat([idx, torch.full_like(idx, 2)], 1)

    torch.manual_seed(0)
    model = MoE(E=3, k=2).double()
    model.gate = Fixed()
    x, y = torch.randn(3, 5, 3, dtype=torch.float64), torch.randint(0, 2, (3,))
    _check(model, x, y, True)


@pytest.mark.parametrize("fused", [True, False])
def test_routed_rows_under_compile_at_another_batch(fused):
    """A router on (B, T, D) whose logits fold the batch (DeepSeek-V3's) and a leaf's experts, compiled after
    an eager step at B = 4: at B = 4 and at B = 2 (an epoch's last batch) the rows are read by the layout the
    eager step found, exact (before, at B = 2: the router's tuple, joined eagerly out of the compiled graph,
    was not read as folded, "none of its inputs has the batch")."""
    torch.manual_seed(4)
    model = LeafMoE().double()
    y = torch.randint(0, 2, (4,))
    batches = [(torch.randn(b, 6, 3, dtype=torch.float64), y[:b]) for b in (4, 4, 2)]
    eager_then_compiled(model, _by_example, batches[:1], batches[1:], fused=fused, loss_reduction="sum")
