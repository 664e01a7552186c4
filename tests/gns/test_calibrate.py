"""Per-layer calibration of the norm form (``elasticlab.gns.calibrate``): the first backward of a shape times
every form on the layer's own inputs and keeps the fastest; later forwards route the layer to it (the C++
autograd function with that form, when built). The timer runs on a virtual clock that every form but one
advances by 30 ms a call, so that the choice is known whatever the machine's load; every step's norms are
checked against torch.func in float64."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from elasticlab.gns import PerSampleGradNorms, calibrate, form_choice, kernels, timing
from elasticlab.gns.layers import conv as conv_rule
from elasticlab.gns.layers import linear as linear_rule
from elasticlab.gns.reference import func_sq_norms

CXX = "linear_norms" in kernels._OPERATORS


CLOCK = [0.0]                           # the virtual clock calibrate reads through timing (seconds)


@pytest.fixture(autouse=True)
def _calibrating(monkeypatch):
    monkeypatch.setattr(calibrate, "ENABLED", True)
    monkeypatch.setattr(calibrate, "REPEATS", 2)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: CLOCK[0]))
    calibrate.reset()
    yield
    calibrate.reset()


def _slowed(monkeypatch, module, factory: str, fast: str, broken: str | None = None):
    """Wraps ``module.<factory>`` so that every form but ``fast`` advances the clock by 30 ms a call (and
    ``broken`` raises)."""
    real = getattr(module, factory)

    def forms(*args):
        out = {}
        for name, fn in real(*args).items():
            if name == broken:
                def fn(name=name):
                    raise RuntimeError(f"{name}: no resources for this tile")
            elif name != fast:
                def fn(fn=fn):
                    CLOCK[0] += 0.03
                    return fn()
            out[name] = fn
        return out
    monkeypatch.setattr(module, factory, forms)


def _spy_forms(monkeypatch, name: str) -> list:
    """The ``form`` argument of each call of the C++ operator ``name`` (empty without the C++ functions)."""
    seen = []
    real = kernels.cxx_autograd

    def spy(op_name, t):
        op = real(op_name, t)
        if op is None or op_name != name:
            return op

        def call(*args):
            seen.append(args[-2] if name == "linear_norms" else args[-4])   # form (before chunk, dtype, tf32)
            return op(*args)
        return call
    monkeypatch.setattr(kernels, "cxx_autograd", spy)
    return seen


def _step_and_check(model, x, y, loss_fn):
    model.zero_grad(set_to_none=True)
    with PerSampleGradNorms(model, loss_reduction="sum") as psg:
        loss_fn(model(x), y).backward()
        got = psg.sq_norms()
    torch.testing.assert_close(got, func_sq_norms(model, loss_fn, x, y), rtol=1e-10, atol=1e-12)


def _seq_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 3)).double()


def _mse(out, y):
    return (out - y).pow(2).sum()


@pytest.mark.parametrize("fast,cxx_form", [("gram", 1), ("outer", 0)])
def test_sequence_linear_takes_the_form_measured_fastest(monkeypatch, fast, cxx_form):
    _slowed(monkeypatch, linear_rule, "seq_forms", fast)
    seen = _spy_forms(monkeypatch, "linear_norms")
    model, x = _seq_model(), torch.randn(4, 10, 6, dtype=torch.float64)
    y = torch.randn(4, 10, 3, dtype=torch.float64)
    _step_and_check(model, x, y, _mse)                       # first step: measured, the fastest's result
    t = calibrate.timings()
    assert len(t) == 2 and all(set(v) == {"outer", "gram"} for v in t.values())
    assert all(min(v, key=v.get) == fast for v in t.values())
    assert all(v[f] == (0.0 if f == fast else pytest.approx(0.03)) for v in t.values() for f in v)
    assert not seen                                          # measuring runs the Python function
    _step_and_check(model, x, y, _mse)                       # then the chosen form, in C++ when built
    assert seen == ([cxx_form] * 2 if CXX else [])
    assert len(calibrate.timings()) == 2                     # nothing measured again


def test_a_form_that_raises_is_left_out(monkeypatch):
    _slowed(monkeypatch, linear_rule, "seq_forms", "outer", broken="gram")
    model, x = _seq_model(), torch.randn(3, 5, 6, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="left out.*'gram': 'RuntimeError: gram: no resources"):
        _step_and_check(model, x, torch.randn(3, 5, 3, dtype=torch.float64), _mse)
    assert all(set(v) == {"outer"} for v in calibrate.timings().values())


def test_a_new_shape_is_measured_again(monkeypatch):
    _slowed(monkeypatch, linear_rule, "seq_forms", "gram")
    model = _seq_model()
    for T in (5, 8):
        x, y = torch.randn(2, T, 6, dtype=torch.float64), torch.randn(2, T, 3, dtype=torch.float64)
        _step_and_check(model, x, y, _mse)
    assert sorted(k[2] for k in calibrate.timings()) == [5, 5, 8, 8]      # (kind, B, T, ...) per layer


def test_nothing_is_measured_when_off(monkeypatch):
    monkeypatch.setattr(calibrate, "ENABLED", False)
    model, x = _seq_model(), torch.randn(2, 5, 6, dtype=torch.float64)
    _step_and_check(model, x, torch.randn(2, 5, 3, dtype=torch.float64), _mse)
    assert calibrate.timings() == {} and calibrate.chosen(("linear",)) is None


@pytest.mark.parametrize("fast,cxx_form", [("grouped", 2), ("patches", 0), ("gram", 1)])
def test_convolutions_take_the_form_measured_fastest(monkeypatch, fast, cxx_form):
    _slowed(monkeypatch, conv_rule, "conv_forms", fast)
    seen = _spy_forms(monkeypatch, "conv_norms")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, stride=2),
                          nn.Flatten(), nn.Linear(2 * 3 * 3, 5)).double()
    x, y = torch.randn(3, 3, 7, 7, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    _step_and_check(model, x, y, _mse)
    t = calibrate.timings()
    assert len(t) == 2 and all(min(v, key=v.get) == fast for v in t.values())
    assert all({"patches", "gram", "grouped"} <= set(v) for v in t.values())
    assert not seen
    _step_and_check(model, x, y, _mse)
    assert seen == ([cxx_form] * 2 if CXX else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_calibration_times_every_form_and_matches_the_default_path():
    """On a GPU under bf16 autocast: every form is timed (the Triton ones too, where Triton is present), and
    the calibrated norms and gradients match those of the default path, steps 1 and 2."""
    from elasticlab.gns import triton_outer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(2), nn.Linear(64, 128),
                          nn.GELU(), nn.Linear(128, 8)).cuda()
    x = torch.randn(8, 3, 8, 8, device="cuda")

    def run():
        model.zero_grad(set_to_none=True)
        with PerSampleGradNorms(model) as psg:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            out.float().pow(2).mean().backward()
            return psg.sq_norms(), [p.grad.clone() for p in model.parameters()]

    calibrate.ENABLED = False
    want = run()
    calibrate.ENABLED = True
    for _ in range(2):
        got = run()
        torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=0)
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=1e-3 * float(w.abs().max()))
    t = calibrate.timings()
    assert {k[0] for k in t} == {"linear", "conv"} and len(t) == 3
    out = calibrate.left_out()                   # forms over the memory rule's limit are not run
    if triton_outer.HAS_TRITON:
        loops = ("nested", "flat", "overlap") if triton_outer.HAS_TMA else ()
        tma = {f"triton-tma-{loop}" for loop in loops}
        assert all({"triton-pointer-nested", "triton-pointer-flat"} | tma <= set(v) | set(out.get(k, {}))
                   for k, v in t.items() if k[0] == "linear")
        assert all("triton" in set(v) | set(out.get(k, {})) for k, v in t.items() if k[0] == "conv")


@pytest.mark.parametrize("limit,want", [(3000.0, "outer"), (0.0, "outer")])
def test_forms_over_the_memory_limit_are_not_run(monkeypatch, limit, want):
    """The memory rule (issue 14's 10% peak-memory target) binds calibration as it binds the default path:
    with a scratch limit below the Gram form's modelled 3200 bytes (B=4, T=10: two 10×10 float32 Grams per
    example), the Gram form, though fastest, is not run, and the layers take the outer form; with a limit
    that no form meets, the one with the least scratch (outer: 4·6·12 and 4·12·3 float64 products)."""
    _slowed(monkeypatch, linear_rule, "seq_forms", "gram")
    monkeypatch.setattr(form_choice, "scratch_limit", lambda device: limit)
    model, x = _seq_model(), torch.randn(4, 10, 6, dtype=torch.float64)
    y = torch.randn(4, 10, 3, dtype=torch.float64)
    _step_and_check(model, x, y, _mse)
    _step_and_check(model, x, y, _mse)
    t, out = calibrate.timings(), calibrate.left_out()
    assert len(t) == 2 and all(set(v) == {want} for v in t.values())
    assert sorted(out.values(), key=str) == [{"gram": 3200}, {"gram": 3200}]
    assert {calibrate.chosen(k) for k in t} == {want}
    calibrate.reset()
    assert calibrate.left_out() == {}


def test_convolution_scratch_models_and_the_limit(monkeypatch):
    """The conv forms' modelled scratch: the patches form's per-example products (B·G·K·Cout/G float64), the
    Gram form's L×L Grams, the grouped form's chunk of per-example gradients and expanded weight; a limit
    between them keeps out exactly the forms above it."""
    m = nn.Conv2d(4, 6, 3, padding=1).double()
    x = torch.randn(5, 4, 8, 8, dtype=torch.float64)
    g = torch.randn(5, 6, 8, 8, dtype=torch.float64)
    sc = conv_rule.conv_scratch(m, x, g, m.weight)
    assert sc == {"patches": 5 * 36 * 6 * 8, "gram": 5 * 2 * 64 * 64 * 4, "grouped": 5 * 6 * 36 * 16}
    monkeypatch.setattr(form_choice, "scratch_limit", lambda device: 20000.0)
    forms = conv_rule.conv_forms(m, x, g, m.weight)
    kept = calibrate.within_memory(("conv", 0), forms, sc, x.device)
    assert set(kept) == {"patches", "grouped"} and calibrate.left_out() == {("conv", 0): {"gram": 163840}}


def test_the_memory_limit_is_a_share_of_the_allocated_memory_on_cuda_only():
    assert form_choice.scratch_limit(torch.device("cpu")) is None
    assert calibrate.within_memory(("x",), {"a": int}, {"a": 10 ** 12}, torch.device("cpu")) == {"a": int}
    with pytest.raises(ValueError, match="no model for form 'triton'"):
        form_choice.scratch_bytes("triton", 1, 1, 1, 1, torch.float32)


def test_when_every_form_raises_the_error_propagates():
    def boom():
        raise RuntimeError("no form fits")
    with pytest.raises(RuntimeError, match="no form fits"):
        calibrate.choose(("linear", 1), {"a": boom, "b": boom}, torch.device("cpu"))
    assert calibrate.timings() == {}


def test_a_compiled_model_gives_eager_norms():
    """Under torch.compile (aot_eager) with calibration on: the norms are eager's (a backward that runs is
    measured, one that is traced keeps the static choice; Dynamo runs these layers' functions eagerly)."""
    model, x = _seq_model(), torch.randn(3, 5, 6, dtype=torch.float64)
    y = torch.randn(3, 5, 3, dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        compiled.zero_grad(set_to_none=True)
        with PerSampleGradNorms(model, loss_reduction="sum") as psg:
            _mse(compiled(x), y).backward()
            got = psg.sq_norms()
        torch.testing.assert_close(got, func_sq_norms(model, _mse, x, y), rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()
