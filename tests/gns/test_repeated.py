"""A module called several times in one forward (gns.repeated): a layer in a hand-written recurrent loop, one
block shared across depth, one encoder on two views. The per-example gradient is the sum over the calls, so
its norm has cross terms; before, the second call was an error ("ran 2 times in one forward"). Each test
compares with torch.func's per-example gradients of the whole model (float64), or of the same model run in
float32 by the C++ functions."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from elasticlab.gns import GNSMonitor, PerSampleGradNorms, repeated
from elasticlab.gns.reference import example_param_sq_norms, func_param_sq_norms, loop_param_sq_norms

B = 6


class Loop(nn.Module):
    """h_t = tanh(W_x x_t + W_h h_{t-1}): two Linears called at every step."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt
        self.inp, self.rec, self.out = nn.Linear(5, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 3)

    def cell(self, x, h):
        return torch.tanh(self.inp(x) + self.rec(h))

    def forward(self, x):
        h = x.new_zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            if self.ckpt is None:
                h = self.cell(x[:, t], h)
            else:
                h = checkpoint(self.cell, x[:, t], h, use_reentrant=self.ckpt == "reentrant")
        return self.out(h)


class Siamese(nn.Module):
    """One encoder (Conv2d, GroupNorm, BatchNorm in eval mode, Linear) on an image and its mirror."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.bn = nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.BatchNorm2d(4).eval()
        self.lin = nn.Linear(64, 6)

    def enc(self, x):
        return self.lin(F.relu(self.bn(self.gn(self.conv(x)))).flatten(1))

    def forward(self, x):
        return (self.enc(x) * self.enc(x.flip(-1)))[:, :3]


class Shared(nn.Module):
    """ALBERT-like: an embedding on two index streams, one (LayerNorm, RMSNorm, Linear) block three times."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln, self.rms = nn.Embedding(11, 8, padding_idx=0), nn.LayerNorm(8), nn.RMSNorm(8)
        self.ff, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, idx):
        h = self.emb(idx) + self.emb((idx + 1) % 11)          # (index 0 pads: no row is all 0)
        for _ in range(3):
            h = h + self.ff(self.rms(self.ln(h)))
        return self.head(h).mean(1)


class Calls(nn.Module):
    """A model holding ``modules`` under their names, whose forward is ``fn(self, x)``: how a test calls
    them."""

    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, m in modules.items():
            setattr(self, name, m)

    def forward(self, x):
        return self.fn(self, x)


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def steps(model, x, y, fused, n=2, **kw):
    """Per-parameter norms and the warnings of ``n`` steps of the same batch."""
    out = []
    with PerSampleGradNorms(model, loss_reduction="sum", fused=fused, **kw) as psn:
        for _ in range(n):
            model.zero_grad()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                loss_fn(model(x), y).backward()
                got = psn.param_sq_norms()
                total = psn.sq_norms()                 # (the readers' fast paths: the shared block)
            if not torch.isnan(total).all():
                torch.testing.assert_close(total, sum(got.values()), rtol=1e-5, atol=0)
            out.append((got, [str(m.message) for m in w]))
    return out


def assert_matches(got, ref, rtol):
    assert got.keys() == ref.keys()
    for k in ref:
        assert ref[k].min() > 0, k
        torch.testing.assert_close(got[k].double(), ref[k].double(), rtol=rtol, atol=0, msg=k)


CASES = {
    "loop": (Loop, lambda: torch.randn(B, 4, 5)),
    "siamese": (Siamese, lambda: torch.randn(B, 2, 6, 6)),
    "shared-block": (Shared, lambda: torch.randint(0, 11, (B, 5))),
}


@pytest.mark.parametrize("case", CASES)
def test_hooks_sum_the_calls_from_the_first_step(case):
    torch.manual_seed(0)
    make, data = CASES[case]
    model = make().double()
    x, y = data(), torch.randint(0, 3, (B,))
    x = x.double() if x.is_floating_point() else x
    ref = func_param_sq_norms(model, loss_fn, x, y)
    for got, warned in steps(model, x, y, fused=False):
        assert warned == []
        assert_matches(got, ref, 1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_fused_module_found_repeated_is_exact_from_the_first_step(case, dtype):
    """The first step keeps each fused call's input and output gradient (gns.repeated.watch), so a fused
    module found repeated there has the norms of all its calls at once, with no warning; from the next step
    it runs on hooks. In float32 (the C++ functions in the first step) as in float64."""
    torch.manual_seed(0)
    make, data = CASES[case]
    model = make().double()
    x, y = data(), torch.randint(0, 3, (B,))
    x = x.double() if x.is_floating_point() else x
    ref = func_param_sq_norms(model, loss_fn, x, y)
    model = model.to(dtype)
    x = x.to(dtype) if x.is_floating_point() else x
    results = steps(model, x, y, fused=True, n=3)
    for got, warned in results:
        assert warned == []
        assert_matches(got, ref, 1e-9 if dtype == torch.float64 else 2e-4)


class Later(nn.Module):
    """A Linear called once per forward until ``twice`` is set, then twice."""

    def __init__(self):
        super().__init__()
        self.lin, self.head, self.twice = nn.Linear(5, 5), nn.Linear(5, 3), False

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return self.head(torch.tanh(self.lin(h)) if self.twice else h)


def test_fused_module_found_repeated_after_the_first_step_is_nan_for_that_step():
    """Only the first step keeps the fused calls: a module first called twice at step 2 gives NaN for it at
    step 2, with one warning naming it, and exact norms from step 3 (on hooks)."""
    torch.manual_seed(0)
    model = Later().double()
    x, y = torch.randn(B, 5, dtype=torch.float64), torch.randint(0, 3, (B,))
    model.twice = True
    ref = func_param_sq_norms(model, loss_fn, x, y)
    model.twice = False
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        loss_fn(model(x), y).backward()
        assert not torch.isnan(psn.sq_norms()).any()
        model.twice = True
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model.zero_grad()
            loss_fn(model(x), y).backward()
            second = psn.param_sq_norms()
        assert torch.isnan(second["lin.weight"]).all() and not torch.isnan(second["head.weight"]).any()
        said = [str(m.message) for m in w]
        assert len([m for m in said if "times in one forward" in m and "NaN" in m]) == 1
        model.zero_grad()
        loss_fn(model(x), y).backward()
        assert_matches(psn.param_sq_norms(), ref, 1e-9)


def test_sq_norms_of_the_spoiled_step_are_nan_and_the_monitor_skips_it():
    torch.manual_seed(1)
    model = Later()
    mon = GNSMonitor(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            model.twice = i >= 1                           # repeated from the second step: NaN there
            with mon.step():
                loss_fn(model(torch.randn(16, 5)), torch.randint(0, 3, (16,))).div(16).backward()
            opt.step()
            opt.zero_grad()
    assert mon.skipped == 1
    assert len(mon.history) == 4 and mon.history[1]["skipped"]
    assert not any(h["skipped"] for i, h in enumerate(mon.history) if i != 1)


@pytest.mark.parametrize("fused", [False, True])
def test_non_reentrant_checkpoint_around_each_call(fused):
    """Non-reentrant: the forward counts every call; the recomputations in the backward are not calls."""
    torch.manual_seed(2)
    model = Loop("non-reentrant").double()
    x, y = torch.randn(B, 4, 5, dtype=torch.float64), torch.randint(0, 3, (B,))
    plain = Loop().double()
    plain.load_state_dict(model.state_dict())
    ref = func_param_sq_norms(plain, loss_fn, x, y)
    results = steps(model, x, y, fused=fused)
    assert_matches(results[-1][0], ref, 1e-9)
    if not fused:
        assert_matches(results[0][0], ref, 1e-9)


def test_reentrant_checkpoint_around_each_call():
    """Reentrant: the calls are counted one segment at a time in the backward, so the first call's gradient
    was taken alone before the module was seen repeated: NaN with a warning once, exact after."""
    torch.manual_seed(3)
    model = Loop("reentrant").double()
    plain = Loop().double()
    plain.load_state_dict(model.state_dict())
    x, y = torch.randn(B, 4, 5, dtype=torch.float64, requires_grad=True), torch.randint(0, 3, (B,))
    ref = func_param_sq_norms(plain, loss_fn, x.detach(), y)
    (first, warned), (second, again) = steps(model, x, y, fused=False)
    assert torch.isnan(first["inp.weight"]).all() and torch.isnan(first["rec.weight"]).all()
    assert any("reentrant" in m for m in warned) and again == []
    assert_matches(second, ref, 1e-9)


def test_a_call_the_loss_does_not_reach_adds_nothing():
    torch.manual_seed(4)
    lin = nn.Linear(4, 4).double()

    def probe(m, x):
        m.seen = m.lin(x.flip(0))                         # gradients on, never backpropagated
        return m.lin(x)

    x = torch.randn(B, 4, dtype=torch.float64)
    model = Calls(probe, lin=lin)
    with PerSampleGradNorms(model, loss_reduction="sum", fused=False) as psn:
        model(x).pow(2).sum().backward()
        got = psn.param_sq_norms()
    want = func_param_sq_norms(lin, lambda o, t: o.pow(2).sum(), x, torch.zeros(B))
    torch.testing.assert_close(got["lin.weight"], want["weight"], rtol=1e-10, atol=0)


def test_calls_on_different_batches_are_an_error():
    model = Calls(lambda m, x: m.lin(x).sum() + m.lin(x[:2]).sum(), lin=nn.Linear(4, 4))
    with PerSampleGradNorms(model, fused=False) as psn:
        model(torch.randn(B, 4)).backward()
        with pytest.raises(RuntimeError, match=r"'lin' \(Linear\) ran on batches of sizes \[(2, 6|6, 2)\]"):
            psn.sq_norms()


def test_fused_only_and_tied_modules_called_twice_are_refused():
    model = Calls(lambda m, x: m.lstm(m.lstm(x)[0])[0], lstm=nn.LSTM(8, 8, batch_first=True))
    with PerSampleGradNorms(model):
        with pytest.raises(RuntimeError, match=r"'lstm' \(LSTM\) ran 2 times.*only a fused form"):
            model(torch.randn(B, 3, 8))

    emb, head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    model = Calls(lambda m, idx: m.head(m.emb(idx) + m.emb(idx.flip(1))), emb=emb, head=head)
    with PerSampleGradNorms(model):
        with pytest.raises(RuntimeError, match="'emb' \\(Embedding\\) ran 2 times.*tied"):
            model(torch.randint(0, 10, (B, 4)))


def test_generic_rule_module_called_twice():
    """A leaf module of no registered type (LayerScale) in a loop: its calls summed by torch.func."""
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.randn(8, dtype=torch.float64))

        def forward(self, x):
            return x * self.gamma

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.head = Scale(), nn.Linear(8, 3).double()

        def forward(self, x):
            return self.head(torch.tanh(self.scale(torch.tanh(self.scale(x)))))

    torch.manual_seed(5)
    model = Net()
    x, y = torch.randn(B, 8, dtype=torch.float64), torch.randint(0, 3, (B,))
    ref = func_param_sq_norms(model, loss_fn, x, y)
    for fused in (False, True):
        for got, warned in steps(model, x, y, fused=fused):
            assert warned == []
            assert_matches(got, ref, 1e-9)


class Decoder(nn.Module):
    """A hand-written loop over a recurrent cell, the hidden state starting at zero (hx=None); ``ckpt``:
    each step under activation checkpointing, reentrant (True) or not (False)."""

    def __init__(self, kind, bias=True, ckpt=None):
        super().__init__()
        self.cell, self.head = getattr(nn, kind)(5, 7, bias=bias), nn.Linear(7, 3)
        self.ckpt = ckpt

    def forward(self, x):
        hx = None
        for t in range(x.shape[1]):
            if self.ckpt is None or hx is None:
                hx = self.cell(x[:, t], hx)
            else:
                hx = checkpoint(self.cell, x[:, t], hx, use_reentrant=self.ckpt)
        return self.head(hx[0] if isinstance(hx, tuple) else hx)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("kind", ["RNNCell", "LSTMCell", "GRUCell"])
def test_cells_in_a_loop_match_one_backward_per_example(kind, T, bias):
    """Exact from the first step: the cells' fused backward keeps each call (no NaN step, no warning). With
    T = 1 the hidden state is 0, so W_hh's norms are 0, as they should be."""
    torch.manual_seed(6)
    model = Decoder(kind, bias).double()
    x, y = torch.randn(B, T, 5, dtype=torch.float64), torch.randint(0, 3, (B,))
    ref = loop_param_sq_norms(model, loss_fn, x, y)
    for got, warned in steps(model, x, y, fused=False):
        assert warned == [] and got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=1e-300, msg=k)
        assert (got["cell.weight_hh"] == 0).all() == (T == 1)


@pytest.mark.parametrize("kind", ["RNNCell", "LSTMCell", "GRUCell"])
def test_cells_forward_and_gradients_are_the_modules_own(kind):
    torch.manual_seed(7)
    model = Decoder(kind)
    x = torch.randn(B, 3, 5)
    want = model(x)
    want.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        got = model(x)
        got.sum().backward()
        assert torch.isfinite(psn.sq_norms()).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], rtol=1e-5, atol=1e-6, msg=k)


def test_cells_under_bf16_autocast():
    torch.manual_seed(8)
    model = Decoder("LSTMCell")
    x, y = torch.randn(32, 5, 5), torch.randint(0, 3, (32,))
    (want, _), = steps(model, x, y, fused=True, n=1)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss_fn(out.float(), y).backward()
        got = psn.param_sq_norms()
    for k in want:
        assert got[k].dtype == torch.float32
        assert ((got[k] - want[k]).abs() / want[k]).median() < 0.02, k


def test_cell_needs_a_batch_dimension():
    model = nn.LSTMCell(5, 7)
    with PerSampleGradNorms(model):
        with pytest.raises(ValueError, match="LSTMCell got an input of shape \\(5,\\)"):
            model(torch.randn(5))


def test_monitor_on_a_cell_loop_skips_no_step():
    torch.manual_seed(9)
    model = Decoder("GRUCell")
    mon = GNSMonitor(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        with mon.step():
            loss_fn(model(torch.randn(16, 4, 5)), torch.randint(0, 3, (16,))).div(16).backward()
        opt.step()
        opt.zero_grad()
    assert mon.skipped == 0 and len(mon.history) == 3
    assert all(h["method"] == "per_example" for h in mon.history)


@pytest.mark.parametrize("fused", [True, False])
def test_repeated_module_under_compile_is_an_error(fused):
    """Under torch.compile a repeated module is refused (Dynamo runs eagerly the frame whose trace raised,
    so the error is also raised there, and at every later step), never a silently wrong sum."""
    torch._dynamo.reset()
    model = Calls(lambda m, x: m.lin(torch.tanh(m.lin(x))), lin=nn.Linear(4, 4))
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, eager_first=False, fused=fused):
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"'lin' \(Linear\) ran 2 times in one forward under"):
                compiled(torch.randn(3, 4)).sum().backward()


@pytest.mark.parametrize("fused", [True, False])
def test_repeated_module_under_compile_after_an_eager_step_is_exact(fused):
    """An eager step finds the module repeated; under torch.compile its hook then runs eagerly (a graph
    break at each call), keeping every call as in eager mode: the compiled steps' norms are one backward per
    example's (before: the error above at every compiled step)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Calls(lambda m, x: m.out(m.lin(torch.tanh(m.lin(x)))), lin=nn.Linear(4, 4),
                  out=nn.Linear(4, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    want = sum(example_param_sq_norms(model, (model(x[b:b + 1]).sum() for b in range(3))).values())
    compiled = torch.compile(model, backend="aot_eager")
    with PerSampleGradNorms(model, fused=fused, loss_reduction="sum") as psn:
        for m in (model, compiled, compiled):
            model.zero_grad()
            m(x).sum().backward()
            torch.testing.assert_close(psn.sq_norms(), want, rtol=1e-10, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("autocast", [False, True])
def test_loop_and_cell_on_the_device_under_autocast(device, autocast):
    """A Linear loop (the C++ functions and, on CUDA, cuBLAS until the switch to hooks) and an LSTMCell
    decoder, in float32 or bf16 autocast, against the float64 reference on the CPU: float32 norms, exact
    to float32 (bf16: median relative error under 2%), from the second step for the Linear loop."""
    torch.manual_seed(10)
    for model in (Loop(), Decoder("LSTMCell")):
        x, y = torch.randn(32, 6, 5), torch.randint(0, 3, (32,))
        ref = func_param_sq_norms(model.double(), loss_fn, x.double(), y) if isinstance(model, Loop) else \
            loop_param_sq_norms(model.double(), loss_fn, x.double(), y)
        model, x, y = model.float().to(device), x.to(device), y.to(device)
        with PerSampleGradNorms(model, loss_reduction="sum") as psn:
            for _ in range(2):
                model.zero_grad()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                        out = model(x)
                    loss_fn(out.float(), y).backward()
                    got = psn.param_sq_norms()
        for k in ref:
            g = got[k].cpu().double()
            assert got[k].dtype == torch.float32, k
            rel = (g - ref[k]).abs() / ref[k].clamp_min(1e-30)
            assert (rel.median() < 0.02) if autocast else (rel.max() < 1e-3), (k, rel.max())


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
def test_cell_loop_under_non_reentrant_checkpointing(kind):
    """Each step checkpointed (not reentrant): the recomputation takes the same path as the forward, so it
    saves the same tensors, and is not a call; the norms are the unchecked loop's from the first step."""
    torch.manual_seed(11)
    plain, model = Decoder(kind).double(), Decoder(kind, ckpt=False).double()
    model.load_state_dict(plain.state_dict())
    x, y = torch.randn(B, 4, 5, dtype=torch.float64), torch.randint(0, 3, (B,))
    ref = loop_param_sq_norms(plain, loss_fn, x, y)
    for got, warned in steps(model, x, y, fused=True):
        assert warned == []
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=0, msg=k)


class SharedAttention(nn.Module):
    """One nn.MultiheadAttention at two depths (self-attention), then as cross-attention on the input."""

    def __init__(self, kind, bias_kv=False, batch_first=True):
        super().__init__()
        self.kind, self.batch_first = kind, batch_first
        self.mha = nn.MultiheadAttention(8, 2, add_bias_kv=bias_kv, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = x if self.batch_first else x.transpose(0, 1)
        h = self.mha(x, x, x)[0]
        h = self.mha(h, h, h)[0]
        if self.kind == "cross":
            h = self.mha(h, x, x)[0]
        h = h if self.batch_first else h.transpose(0, 1)
        return self.head(h.mean(1))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind, bias_kv, batch_first", [("self", False, True), ("cross", True, False)])
def test_attention_called_at_several_depths(kind, bias_kv, batch_first, fused):
    """MHA's fused backward keeps each call's projection blocks and bias rows (summed_parts): exact from
    the first step; so is its out_proj, a fused Linear whose first step's calls are kept."""
    torch.manual_seed(12)
    model = SharedAttention(kind, bias_kv, batch_first).double()
    with torch.no_grad():
        for p in model.mha.parameters():
            p.normal_(0, 0.5)
    x, y = torch.randn(B, 4, 8, dtype=torch.float64), torch.randint(0, 3, (B,))
    ref = loop_param_sq_norms(model, loss_fn, x, y)
    (first, warned), (second, again) = steps(model, x, y, fused=fused)
    assert warned == again == []
    for got in (first, second):
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=0, msg=k)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_module_called_outside_and_inside_a_checkpointed_segment(reentrant):
    """Not reentrant: the forward counts both calls, the replay none: exact. Reentrant: the segment's call
    is made in the backward, where it cannot be told from a replay of the call outside: an error, where the
    norms silently missed that call before."""
    torch.manual_seed(13)
    lin = nn.Linear(4, 4).double()

    def mixed(ckpt):
        def forward(m, x):
            h = torch.tanh(m.lin(x))
            return m.lin(h) if ckpt is None else checkpoint(m.lin, h, use_reentrant=ckpt)
        return Calls(forward, lin=lin)

    x = torch.randn(B, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 3, (B,))
    ref = func_param_sq_norms(mixed(None), loss_fn, x.detach(), y)
    model = mixed(reentrant)
    with PerSampleGradNorms(model, loss_reduction="sum", fused=False) as psn:
        loss_fn(model(x), y).backward()
        if reentrant:
            with pytest.raises(RuntimeError, match=r"'lin' \(Linear\) ran in the forward and again inside a "
                                                   "reentrant"):
                psn.sq_norms()
        else:
            got = psn.param_sq_norms()
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=1e-9, atol=0, msg=k)


def test_the_first_step_lets_go_of_the_calls_of_modules_called_once(monkeypatch):
    """The first step's fused calls are kept only while the forward runs: after it, those of modules called
    once are emptied (no input held past its graph), those of a repeated module wait for its backward."""
    torch.manual_seed(0)
    model = Later().double()
    model.twice = True
    x, y = torch.randn(B, 5, dtype=torch.float64), torch.randint(0, 3, (B,))
    boxes, release = {}, repeated.release

    def spy(slots):
        boxes.update({s.name: list(s.watched) for s in slots})
        release(slots)
    monkeypatch.setattr(repeated, "release", spy)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        out = model(x)
        assert [len(b) for b in boxes["lin"]] == [1, 1] and [len(b) for b in boxes["head"]] == [0]
        loss_fn(out, y).backward()
        assert [len(b) for b in boxes["lin"]] == [0, 0]          # (taken by the backward's hooks)
        assert not torch.isnan(psn.sq_norms()).any()


def test_a_first_forward_without_gradients_leaves_the_watch_to_the_first_that_trains():
    """An evaluation under no_grad before training does not spend the first step's watch: the first forward
    with gradients keeps the fused calls, so ALBERT-like sharing is exact from it."""
    torch.manual_seed(0)
    model = Shared().double()
    x, y = torch.randint(0, 11, (B, 5)), torch.randint(0, 3, (B,))
    ref = func_param_sq_norms(model, loss_fn, x, y)
    with PerSampleGradNorms(model, loss_reduction="sum") as psn:
        with torch.no_grad():
            model(x)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            loss_fn(model(x), y).backward()
            got = psn.param_sq_norms()
    assert not [m for m in w if "times in one forward" in str(m.message)]
    assert_matches(got, ref, 1e-9)
