"""GNSMonitor against GNSEstimator fed the same batches by hand: per-example, micro-batch (accumulation),
bf16 autocast, a GradScaler (scale divided out, overflow skipped and counted), DDP replicas (2 gloo)."""
import contextlib
import copy
import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from gloo_util import run_gloo
from torch import nn

from elasticlab.gns import GNSEstimator, GNSMonitor, PerSampleGradNorms
from elasticlab.gns.layers import broadcast_params

RTOL = 1e-6


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))


def batches(n_steps, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 3, generator=g)
    out = []
    for _ in range(n_steps):
        x = torch.randn(batch, 6, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def close(a, b, rtol=RTOL):
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def test_per_example_matches_estimator_on_the_same_batches():
    data = batches(6, 8)
    model = make_model()
    ref_model = copy.deepcopy(model)
    mon = GNSMonitor(model, beta=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        with mon.step():
            F.cross_entropy(model(x), y).backward()
        opt.step()
    ref, opt = GNSEstimator(beta=0.9), torch.optim.SGD(ref_model.parameters(), lr=0.1)
    expected = []
    with PerSampleGradNorms(ref_model) as norms:
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(ref_model(x), y).backward()
            ref.update_from(norms)
            expected.append(ref.b_simple)
            opt.step()
    assert [h["method"] for h in mon.history] == ["per_example"] * 6
    assert [h["step"] for h in mon.history] == list(range(1, 7))
    for h, e in zip(mon.history, expected):
        assert close(h["b_simple"], e), (h["b_simple"], e)
    assert math.isfinite(mon.b_simple) and mon.b_simple > 0
    for name, v in ref.layer_b_simple().items():
        assert close(mon.layer_b_simple()[name], v)
    assert set(mon.history[-1]["layers"]) == {"0", "2", "3"}


def _micro_grads(model, parts, weight):
    """Each micro-batch's gradient (weighted loss) and the accumulated one, by torch.autograd.grad."""
    params = list(model.parameters())
    gs = [torch.autograd.grad(F.cross_entropy(model(x), y) * weight, params) for x, y in parts]
    total = [sum(g[i] for g in gs) for i in range(len(params))]
    sq = [sum(float(t.double().pow(2).sum()) for t in g) for g in gs]
    return sq, sum(float(t.double().pow(2).sum()) for t in total)


@pytest.mark.parametrize("accumulation,sizes,dtype", [("mean", (4, 4, 4), torch.float32),
                                                      ("sum", (2, 5, 3), torch.float32),
                                                      ("sum", (2, 5, 3), torch.float64)])
def test_micro_batch_form_with_accumulation(accumulation, sizes, dtype):
    """(float64: before, the gradients' norms were asked for in float32, and raised)"""
    model = make_model().to(dtype)
    mon = GNSMonitor(model, beta=0.5, accumulation=accumulation)
    ref = GNSEstimator(beta=0.5)
    k = len(sizes)
    w = 1.0 / k if accumulation == "mean" else 1.0
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    for x, y in batches(4, sum(sizes), seed=3):
        x = x.to(dtype)
        parts = list(zip(x.split(list(sizes)), y.split(list(sizes))))
        sq, big = _micro_grads(model, parts, w)
        h = k / sum(1.0 / b for b in sizes)
        ref.update_two_batch(sum(s / w ** 2 for s in sq) / k, big / (w * k) ** 2, h, k * h)
        model.zero_grad()
        with mon.step():
            for xb, yb in parts:
                (F.cross_entropy(model(xb), yb) * w).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)   # after the step: must not matter
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
        assert close(mon.history[-1]["b_simple"], ref.b_simple, rtol), (mon.history[-1], ref)
        assert close(mon.grad_sq, ref.grad_sq, rtol) and close(mon.trace_cov, ref.trace_cov, rtol)
    assert mon.history[-1]["method"] == "micro_batch" and mon.history[-1]["batch_size"] == sum(sizes)
    assert mon.history[-1]["micro_batches"] == k and mon.layer_b_simple().keys() == {"0", "2", "3"}


def test_clipping_inside_the_step_does_not_change_the_estimate():
    data = batches(3, 8)
    a, b = make_model(), make_model()
    ma, mb = GNSMonitor(a), GNSMonitor(b)
    for x, y in data:
        with ma.step():
            F.cross_entropy(a(x), y).backward()
        with mb.step():
            F.cross_entropy(b(x), y).backward()
            torch.nn.utils.clip_grad_norm_(b.parameters(), 1e-4)
        a.zero_grad()
        b.zero_grad()
    assert close(ma.b_simple, mb.b_simple)


def test_bf16_autocast_per_example_and_micro_batch():
    data = batches(3, 8)
    model, ref_model = make_model(), make_model()
    mon, ref = GNSMonitor(model), GNSEstimator()
    with PerSampleGradNorms(ref_model) as norms:
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                F.cross_entropy(ref_model(x), y).backward()
            ref.update_from(norms)
            ref_model.zero_grad()
    for x, y in data:
        with mon.step(), torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(x), y).backward()
        model.zero_grad()
    assert close(mon.b_simple, ref.b_simple, 1e-5)
    # bf16 is close to float32 (same batches, no optimizer step)
    f32 = GNSMonitor(make_model())
    for x, y in data:
        with f32.step():
            F.cross_entropy(f32.model(x), y).backward()
        f32.model.zero_grad()
    assert abs(mon.b_simple - f32.b_simple) < 0.05 * f32.b_simple
    acc = GNSMonitor(make_model())
    with acc.step(), torch.autocast("cpu", dtype=torch.bfloat16):
        for xb, yb in zip(data[0][0].split(4), data[0][1].split(4)):
            (F.cross_entropy(acc.model(xb), yb) / 2).backward()
    assert acc.history[-1]["method"] == "micro_batch" and math.isfinite(acc.history[-1]["b_simple"])


@pytest.mark.parametrize("micro", [1, 2])
def test_grad_scaler_scale_divided_out_and_overflow_skipped(micro):
    data = batches(4, 8)
    plain, scaled = make_model(), make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    mp_, ms = GNSMonitor(plain, beta=0.5), GNSMonitor(scaled, beta=0.5, grad_scaler=scaler)
    opt = torch.optim.SGD(scaled.parameters(), lr=0.0)
    for step, (x, y) in enumerate(data):
        parts = list(zip(x.split(8 // micro), y.split(8 // micro)))
        with mp_.step():
            for xb, yb in parts:
                (F.cross_entropy(plain(xb), yb) / micro).backward()
        plain.zero_grad()
        with ms.step():
            for xb, yb in parts:
                loss = F.cross_entropy(scaled(xb), yb) / micro
                if step == 2:
                    loss = loss * float("inf")                 # an overflowed step
                scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert ms.skipped == 1 and ms.history[2]["skipped"] and not ms.history[3]["skipped"]
    assert scaler.get_scale() < 2.0 ** 10                       # the scaler saw the overflow too
    ref = GNSMonitor(make_model(), beta=0.5)                    # the plain run without step 2
    for step, (x, y) in enumerate(data):
        if step == 2:
            continue
        with ref.step():
            for xb, yb in zip(x.split(8 // micro), y.split(8 // micro)):
                (F.cross_entropy(ref.model(xb), yb) / micro).backward()
        ref.model.zero_grad()
    assert close(ms.b_simple, ref.b_simple, 1e-5), (ms, ref)
    assert not close(ms.b_simple, mp_.b_simple, 1e-5)           # the skipped step is really left out


def test_every_and_state_dict():
    model = make_model()
    mon = GNSMonitor(model, every=3)
    for x, y in batches(7, 8):
        with mon.step():
            F.cross_entropy(model(x), y).backward()
        model.zero_grad()
    assert [h["step"] for h in mon.history] == [1, 4, 7] and mon.estimator.num_updates == 3
    other = GNSMonitor(make_model())
    other.load_state_dict(mon.state_dict())
    assert other.b_simple == mon.b_simple and other.history == mon.history and other.steps == 7


def test_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="every"):
        GNSMonitor(make_model(), every=0)
    with pytest.raises(ValueError, match="method"):
        GNSMonitor(make_model(), method="magic")
    with pytest.raises(ValueError, match="replica"):
        GNSMonitor(make_model(), method="replica")
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum', got 'avg'"):
        GNSMonitor(make_model(), loss_reduction="avg")      # not taken for per-example norms unavailable

    class Scaled(nn.Module):                  # a parameter no per-example rule covers (that rule off)
        def __init__(self):
            super().__init__()
            self.lin, self.s = nn.Linear(6, 3), nn.Parameter(torch.ones(3))

        def forward(self, x):
            return self.lin(x) * self.s

    m = Scaled()
    monkeypatch.setattr(broadcast_params, "ENABLED", False)
    mon = GNSMonitor(m)
    x, y = batches(1, 8)[0]
    with pytest.raises(RuntimeError, match="Accumulate >= 2"):
        with mon.step():
            F.cross_entropy(m(x), y).backward()
    m.zero_grad()
    with mon.step():                          # with accumulation it works (micro-batch form)
        for xb, yb in zip(x.split(4), y.split(4)):
            (F.cross_entropy(m(xb), yb) / 2).backward()
    assert mon.history[-1]["method"] == "micro_batch"
    model = make_model()
    mon = GNSMonitor(model)
    loss = F.cross_entropy(model(x), y)       # forward outside the step
    with pytest.raises(RuntimeError, match="forward inside the step"):
        with mon.step():
            loss.backward()
    model.zero_grad()
    with pytest.raises(ValueError, match="micro-batch sizes"):
        with GNSMonitor(model, method="micro_batch").step():
            for _ in range(2):
                (model[3](torch.randn(2, 16)).sum()).backward()   # forwards of a submodule: no size


# ---- DDP: two gloo processes ----------------------------------------------------------------------
WORLD, B_LOCAL, STEPS = 2, 6, 3


def _ddp_worker(rank, opts=None):
    res, opts = {}, opts or {}
    # (static_graph: DDP itself cannot accumulate under no_sync, "expect_autograd_hooks_ INTERNAL ASSERT")
    runs = (("ddp", 1), ("ddp", 2), ("inner", 1), ("inner", 2))
    for wrap, micro in runs[::2] if "static_graph" in opts else runs:
        model = nn.parallel.DistributedDataParallel(make_model(), **opts)
        # "inner": the monitor sees the plain module (as a HF callback does) on the process group
        mon = GNSMonitor(model if wrap == "ddp" else model.module, beta=0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches(STEPS, WORLD * B_LOCAL):
            xs, ys = x[rank * B_LOCAL:(rank + 1) * B_LOCAL], y[rank * B_LOCAL:(rank + 1) * B_LOCAL]
            opt.zero_grad()
            with mon.step():
                for j, (xb, yb) in enumerate(zip(xs.split(B_LOCAL // micro), ys.split(B_LOCAL // micro))):
                    ctx = model.no_sync() if j < micro - 1 else torch.enable_grad()
                    with ctx:
                        (F.cross_entropy(model(xb), yb) / micro).backward()
            opt.step()
        res[wrap, micro] = mon.history
    return res


@pytest.mark.parametrize("opts", [{}, {"gradient_as_bucket_view": True, "find_unused_parameters": True,
                                        "bucket_cap_mb": 1e-4}, {"static_graph": True}])
def test_ddp_replica_form_two_gloo_processes(tmp_path, opts):
    """``opts``: DDP's own (the gradients views of its buckets, one parameter a bucket, the graph static): the
    same estimates as by default."""
    res = run_gloo(functools.partial(_ddp_worker, opts=opts), WORLD, tmp_path)
    # one process: the replicas' (or micro-batches') gradients and their average, the same SGD steps
    model = make_model()
    params = list(model.parameters())
    refs = {"replica": GNSEstimator(beta=0.5), "per_example": GNSEstimator(beta=0.5),
            "micro_batch": GNSEstimator(beta=0.5)}
    def parts_of(x, y, size):
        return [torch.autograd.grad(F.cross_entropy(model(xb), yb), params)
                for xb, yb in zip(x.split(size), y.split(size))]

    def sq(g, layer=None):
        return sum(float(t.double().pow(2).sum()) for t, n in zip(g, names) if layer in (None, n))

    names = [n.rpartition(".")[0] for n, _ in model.named_parameters()]        # each parameter's module
    for x, y in batches(STEPS, WORLD * B_LOCAL):
        local, micro = parts_of(x, y, B_LOCAL), parts_of(x, y, B_LOCAL // 2)
        mean = [sum(g[i] for g in local) / WORLD for i in range(len(params))]
        for layer in (None, *dict.fromkeys(names)):          # the whole model, then each layer
            refs["replica"].update_two_batch(sum(sq(g, layer) for g in local) / WORLD, sq(mean, layer),
                                             B_LOCAL, WORLD * B_LOCAL, layer=layer)
            refs["micro_batch"].update_two_batch(sum(sq(g, layer) for g in micro) / len(micro),
                                                 sq(mean, layer), B_LOCAL // 2, WORLD * B_LOCAL, layer=layer)
        with PerSampleGradNorms(model) as norms:
            F.cross_entropy(model(x), y).backward()
            refs["per_example"].update(norms.sq_norms(), sq(mean), layers={
                n: (v, sq(mean, n)) for n, v in norms.layer_sq_norms().items()})
        model.zero_grad()
        with torch.no_grad():
            for p, g in zip(params, mean):
                p -= 0.1 * g
    expect = {("ddp", 1): "replica", ("ddp", 2): "replica", ("inner", 1): "per_example",
              ("inner", 2): "micro_batch"}
    for key, method in expect.items():
        ref = refs[method]
        for r in range(WORLD):
            if key not in res[r] and "static_graph" in opts:
                continue
            h = res[r][key]
            assert [e["method"] for e in h] == [method] * STEPS and h[-1]["batch_size"] == WORLD * B_LOCAL
            assert close(h[-1]["b_simple"], ref.b_simple, 1e-5), (key, r, h[-1], ref)
            layers = ref.layer_b_simple()                   # per layer too (before: none when world > 1)
            assert set(h[-1]["layers"]) == set(layers) == {"0", "2", "3"}
            for name, v in layers.items():
                assert close(h[-1]["layers"][name], v, 1e-5), (key, name, h[-1]["layers"], layers)


SIZES = (7, 3)   # unequal process batches (an elastic sampler's, a last partial batch)


def _unequal_worker(rank):
    model = nn.parallel.DistributedDataParallel(make_model())
    mon = GNSMonitor(model.module, beta=0.5)           # the plain module on the process group (the HF case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(STEPS, sum(SIZES)):
        xs, ys = x.split(SIZES)[rank], y.split(SIZES)[rank]
        opt.zero_grad()
        with mon.step():
            F.cross_entropy(model(xs), ys).backward()
        opt.step()
    return mon.history


def test_per_example_form_over_unequal_process_batches_uses_their_harmonic_mean(tmp_path):
    """Per-example form on 2 processes with batches of 7 and 3: DDP averages the two batch means, so
    E‖ḡ‖² = ‖G‖² + tr Σ/(R·H) (McCandlish Eq. A.1, H the batches' harmonic mean), not tr Σ/n: B_big = R·H
    (4.2 here; the fold used n = 10 before)."""
    res = run_gloo(_unequal_worker, WORLD, tmp_path)
    model = make_model()
    params = list(model.parameters())
    ref, b_big = GNSEstimator(beta=0.5), WORLD * WORLD / sum(1.0 / b for b in SIZES)
    for x, y in batches(STEPS, sum(SIZES)):
        parts = [torch.autograd.grad(F.cross_entropy(model(xb), yb), params)
                 for xb, yb in zip(x.split(SIZES), y.split(SIZES))]
        mean = [sum(g[i] for g in parts) / WORLD for i in range(len(params))]
        with PerSampleGradNorms(model) as norms:
            F.cross_entropy(model(x), y).backward()
            sq = norms.sq_norms()
        ref.update_two_batch(float(sq.double().mean()), sum(float(g.double().pow(2).sum()) for g in mean),
                             1, b_big)
        model.zero_grad()
        with torch.no_grad():
            for p, g in zip(params, mean):
                p -= 0.1 * g
    for r in range(WORLD):
        h = res[r]
        assert [e["method"] for e in h] == ["per_example"] * STEPS and h[-1]["batch_size"] == sum(SIZES)
        assert close(h[-1]["b_simple"], ref.b_simple, 1e-5), (r, h[-1]["b_simple"], ref.b_simple)


def _synced_worker(rank):
    """Accumulation under DDP with every backward synchronised (no ``no_sync``), then with it."""
    model = nn.parallel.DistributedDataParallel(make_model())
    mon = GNSMonitor(model, beta=0.5)
    seen = []
    for synced in (True, True, False):
        x, y = batches(1, WORLD * B_LOCAL)[0]
        xs, ys = x[rank * B_LOCAL:(rank + 1) * B_LOCAL], y[rank * B_LOCAL:(rank + 1) * B_LOCAL]
        model.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with mon.step():
                for j, (xb, yb) in enumerate(zip(xs.split(3), ys.split(3))):
                    with model.no_sync() if j == 0 and not synced else contextlib.nullcontext():
                        (F.cross_entropy(model(xb), yb) / 2).backward()
        seen.append((len(mon.history), mon.unmeasured, [str(w.message) for w in caught]))
    return seen


def test_ddp_accumulation_without_no_sync_is_not_measured(tmp_path):
    """Each backward all-reduced: the second's bucket holds the first's averaged gradient plus its own, and
    the replica form had summed the buckets' norms (B_simple 2.7x too large, silently). Now such a step goes
    unmeasured, with one warning naming no_sync; a step under no_sync is measured again."""
    for seen in run_gloo(_synced_worker, WORLD, tmp_path):
        (h1, u1, w1), (h2, u2, w2), (h3, u3, w3) = seen
        assert (h1, u1, h2, u2, h3, u3) == (0, 1, 0, 2, 1, 2)
        assert len(w1) == 1 and "all-reduced the gradient in 2 of this step's 2 backwards" in w1[0]
        assert "no_sync" in w1[0] and w2 == [] and w3 == []


def test_one_backward_after_accumulation_measures_per_example_from_the_next_step():
    """auto: per-example norms are off after a step of several backwards (their cost saved); a step of one
    backward then goes unmeasured, and turns them on again from the next (before: off for good)."""
    model = make_model()
    mon = GNSMonitor(model, beta=0.5)
    (x, y), = batches(1, 8)
    with mon.step():
        for xb, yb in zip(x.split(4), y.split(4)):
            (F.cross_entropy(model(xb), yb) / 2).backward()
    for _ in range(3):
        model.zero_grad()
        with mon.step():
            F.cross_entropy(model(x), y).backward()
    assert [(h["step"], h["method"]) for h in mon.history] == [
        (1, "micro_batch"), (3, "per_example"), (4, "per_example")]
    assert mon.unmeasured == 1


@pytest.mark.parametrize("kwargs, msg", [
    ({"every": True}, "every must be an integer >= 1, got True"),
    ({"every": "2"}, "every must be an integer >= 1, got '2'"),
    ({"beta": "0.9"}, r"beta must be in \[0, 1\), got '0.9'"),
    ({"init_batch_size": 0}, "init_batch_size must be >= 1, got 0"),
])
def test_settings_rules_are_the_callbacks_rules(kwargs, msg):
    """One rule each (gns.forms.check_settings), so the monitor and the callbacks cannot drift apart: the
    monitor took every=True as 1, and a string beta gave a TypeError from the comparison."""
    from elasticlab.gns.forms import check_settings

    with pytest.raises(ValueError, match=msg):
        GNSMonitor(make_model(), **kwargs)
    if "init_batch_size" not in kwargs:
        settings = {"every": 1, "beta": 0.99, "method": "auto", **kwargs}
        with pytest.raises(ValueError, match=msg):
            check_settings(**settings)
    assert GNSMonitor(make_model(), every=2.0).every == 2


def test_one_coverage_check_per_measured_step(monkeypatch):
    """A step's readers (per-example, per-layer and gradient norms) run the coverage check once, within
    PerSampleGradNorms.reading() (before: three times); a reader after it checks again, so a strict refusal
    of parameters that got no norm is not lost."""
    import elasticlab.gns.norms as norms_mod
    calls = []
    real = norms_mod.unmeasured
    monkeypatch.setattr(norms_mod, "unmeasured", lambda *a: calls.append(1) or real(*a))
    model = make_model()
    mon = GNSMonitor(model)
    for i, (x, y) in enumerate(batches(3, 8), 1):
        model.zero_grad()
        with mon.step():
            F.cross_entropy(model(x), y).backward()
        assert len(calls) == i
    assert set(mon.history[-1]["layers"]) == {"0", "2", "3"}


    class Direct(nn.Module):                # ``head`` used by F.linear: its module never runs
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return F.linear(torch.tanh(self.lin(x)), self.head.weight, self.head.bias)

    direct = Direct()
    with PerSampleGradNorms(direct) as psn:
        direct(batches(1, 4)[0][0]).sum().backward()
        for _ in range(2):
            n = len(calls)
            with pytest.raises(RuntimeError, match="never ran"):
                with psn.reading():
                    pass
            with pytest.raises(RuntimeError, match="never ran"):
                psn.sq_norms()
            assert len(calls) == n + 2


def test_nested_reading_keeps_the_outer_check(monkeypatch):
    """A ``reading()`` within another uses the outer one's coverage check and, at its exit, leaves it for
    the rest of the outer block (before, the inner exit cleared it and later readers checked again)."""
    import elasticlab.gns.norms as norms_mod
    calls = []
    real = norms_mod.unmeasured
    monkeypatch.setattr(norms_mod, "unmeasured", lambda *a: calls.append(1) or real(*a))
    model = make_model()
    x, y = batches(1, 8)[0]
    with PerSampleGradNorms(model) as psn:
        F.cross_entropy(model(x), y).backward()
        with psn.reading():
            first = psn.sq_norms().clone()
            with psn.reading():
                psn.layer_sq_norms()
            torch.testing.assert_close(psn.sq_norms(), first)
        assert len(calls) == 1
        psn.sq_norms()                          # outside: checked again
        assert len(calls) == 2
