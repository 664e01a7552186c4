"""The per-shape choice among the Triton kernel's variants (``elasticlab.gns.triton_tune``).

Runs where the kernel runs: on a CUDA device, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, ``.ci/triton_interpret.sh``), where tuning is forced on (it is for GPUs only) so
that its logic is exercised:
which variants it times, what it keeps, that the result it returns is a correct one, that a variant that
raises is left out, and when it stays off.
"""
import pytest
import torch

from elasticlab.gns import kernels, triton_gram, triton_launch, triton_outer, triton_tune

DEV = triton_launch.kernel_device() or pytest.skip(
    "the Triton kernels need Triton and a CUDA device, or TRITON_INTERPRET=1", allow_module_level=True)
INTERPRET = triton_launch.INTERPRETED
pytestmark = [] if INTERPRET else [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    triton_tune.reset()
    if INTERPRET:                           # CPU tensors: force the tuning on (active() says no off CUDA)
        monkeypatch.setattr(triton_tune, "active", lambda a: triton_tune.ENABLED)
        monkeypatch.setattr(triton_tune, "follows", lambda a: triton_tune.ENABLED)
    yield
    triton_tune.reset()


def _inputs(B, T, Din, Dout, dtype=torch.float16):
    g = torch.Generator().manual_seed(B * 100 + T)
    a = torch.randn(B, T, Din, generator=g).to(DEV, dtype)
    d = (torch.randn(B, T, Dout, generator=g) / T ** 0.5).to(DEV, dtype)
    return a, d


def _reference(a, d):
    return kernels.seq_linear_outer_norms_ref(a.double().cpu(), d.double().cpu(), with_grad=True)


def _close(got, want, grad_tol=2e-5):
    """Norms against float64 to float32's summation error; the gradient to ``grad_tol`` (the fused Gram form's
    comes from the plain GEMM in the inputs' dtype: one float16 rounding, 2^-11)."""
    n, g = got
    rn, rg = want
    torch.testing.assert_close(n.double().cpu(), rn, rtol=2e-5, atol=1e-6 * float(rn.max()))
    torch.testing.assert_close(g.double().cpu(), rg, rtol=grad_tol, atol=grad_tol * float(rg.abs().max()))


def _count_configs(monkeypatch) -> list:
    """The config of each triton_outer.outer_norms call from now on (the call still runs)."""
    seen, real = [], triton_outer.outer_norms

    def spy(a, d, with_grad, config=None, bias=False):
        seen.append(config)
        return real(a, d, with_grad, config, bias)

    monkeypatch.setattr(triton_outer, "outer_norms", spy)
    return seen


def test_first_call_times_every_variant_and_later_calls_run_the_kept_one(monkeypatch):
    a, d = _inputs(3, 40, 32, 48)
    assert not triton_gram.worthwhile(40, 32, 48)            # the outer kernel's variants only
    seen = _count_configs(monkeypatch)
    monkeypatch.setattr(triton_tune, "REPEATS", 2)
    bars, real_progress = [], triton_tune.timing._progress
    monkeypatch.setattr(triton_tune.timing, "_progress", lambda n, desc: bars.append((n, desc))
                        or real_progress(n, desc))
    want = _reference(a, d)
    _close(triton_tune.outer_norms(a, d, True), want)
    names = [triton_tune.variant_name(c) for c in triton_tune.candidates(a, d)]
    assert bars == [(len(names), "triton_tune 3x40x32x48")]             # a progress bar over the forms
    expect = {"pointer-nested", "pointer-flat"}
    if triton_outer.tma_ok(a, d):
        expect |= {"tma-nested", "tma-flat", "tma-overlap"}
    expect |= {n + "-swap" for n in expect}                 # Din ≠ Dout: each on the mirrored shape too
    assert set(names) == expect and len(names) == len(expect)
    assert len(seen) == 3 * len(names)                   # each variant: one warm-up call, then REPEATS timed
    (key, times), = triton_tune.tunings().items()
    assert key[:4] == (3, 40, 32, 48) and set(times) == expect and all(t > 0 for t in times.values())
    kept = triton_tune.chosen()[key]
    assert kept == min(times, key=times.get)
    seen.clear()
    _close(triton_tune.outer_norms(a, d, True), want)     # the kept variant, once, no timing
    assert [triton_tune.variant_name(c) for c in seen] == [kept]
    # norms only is another key, tuned at its own first call
    n, g = triton_tune.outer_norms(a, d, False)
    assert g is None and len(triton_tune.tunings()) == 2
    torch.testing.assert_close(n.double().cpu(), want[0], rtol=2e-5, atol=1e-6 * float(want[0].max()))


def test_the_fused_gram_form_is_timed_where_its_multiply_adds_are_fewer(monkeypatch):
    """Din = Dout = 256 at T = 40: one 64-row block pair an example (64²·512 multiply-adds against
    40·256²), so ``ghost`` is a candidate; whichever form is kept, the result is right, and with ``ghost``
    forced to win its gradient is the plain GEMM's."""
    a, d = _inputs(2, 40, 256, 256)
    assert triton_gram.worthwhile(40, 256, 256)
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    want = _reference(a, d)
    _close(triton_tune.outer_norms(a, d, True), want, grad_tol=1e-3)
    (times,) = triton_tune.tunings().values()
    assert "ghost" in times and "pointer-nested" in times
    triton_tune.reset()
    real = triton_tune.timing.elapsed                     # the clock says ghost is the fastest

    def clock(fn, device, repeats=3):
        real(fn, device, 1)                               # still runs the form
        return 0.0 if fn.func is triton_tune.ghost else 1.0

    monkeypatch.setattr(triton_tune.timing, "elapsed", clock)
    _close(triton_tune.outer_norms(a, d, True), want, grad_tol=1e-3)
    assert list(triton_tune.chosen().values()) == ["ghost"]
    n, g = triton_tune.outer_norms(a, d, True)           # the kept form, no timing
    assert g.dtype == a.dtype                             # the plain GEMM's gradient, in the inputs' dtype
    _close((n, g), want, grad_tol=1e-3)
    monkeypatch.setattr(triton_tune, "GHOST", False)
    assert "ghost" not in triton_tune.forms(a, d, True)


def test_each_config_of_the_fused_gram_form_is_a_form_and_the_kept_one_runs_with_its_config(monkeypatch):
    """float16 operands: ``ghost`` and ``ghost-k128`` are timed apart; with the clock saying ``ghost-k128``
    is the fastest it is kept, and later calls run the Gram kernel with its K step of 128."""
    a, d = _inputs(2, 40, 256, 256)
    found = triton_tune.forms(a, d, True)
    assert {n for n in found if n.startswith("ghost")} == {"ghost", "ghost-k128"}
    assert found["ghost-k128"][1][1] == 128 and found["ghost"][1][1] == 64
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    real = triton_tune.timing.elapsed

    def clock(fn, device, repeats=3):
        real(fn, device, 1)
        return 0.0 if getattr(fn, "args", ())[3:4] == (found["ghost-k128"][1],) else 1.0

    monkeypatch.setattr(triton_tune.timing, "elapsed", clock)
    want = _reference(a, d)
    _close(triton_tune.outer_norms(a, d, True), want, grad_tol=1e-3)
    assert list(triton_tune.chosen().values()) == ["ghost-k128"]
    configs, real_ghost = [], triton_gram.ghost_norms
    monkeypatch.setattr(triton_gram, "ghost_norms", lambda a, d, config=None: configs.append(config)
                        or real_ghost(a, d, config))
    _close(triton_tune.outer_norms(a, d, True), want, grad_tol=1e-3)
    assert configs == [found["ghost-k128"][1]]


def test_a_variant_that_raises_is_left_out_with_a_warning(monkeypatch):
    a, d = _inputs(2, 17, 24, 40)
    real = triton_outer.outer_norms

    def flaky(a, d, with_grad, config=None, bias=False):
        if config is not None and config[5]:                  # the flat loop "does not fit" this device
            raise RuntimeError("out of resources: shared memory, required: 300000")
        return real(a, d, with_grad, config, bias)

    monkeypatch.setattr(triton_outer, "outer_norms", flaky)
    with pytest.warns(RuntimeWarning, match="pointer-flat.*out of resources"):
        _close(triton_tune.outer_norms(a, d, True), _reference(a, d))
    (times,) = triton_tune.tunings().values()
    assert times and not any("-flat" in name for name in times)


def test_when_every_variant_raises_the_error_propagates(monkeypatch):
    a, d = _inputs(2, 9, 16, 16)

    def broken(a, d, with_grad, config=None, bias=False):
        raise RuntimeError("no variant compiles here")

    monkeypatch.setattr(triton_outer, "outer_norms", broken)
    with pytest.raises(RuntimeError, match="no variant compiles here"):
        triton_tune.outer_norms(a, d, True)
    assert triton_tune.tunings() == {}


def test_tma_variants_can_be_kept_out(monkeypatch):
    a, d = _inputs(2, 9, 16, 24)
    monkeypatch.setattr(triton_tune, "TMA", False)
    assert {triton_tune.variant_name(c) for c in triton_tune.candidates(a, d)} == {
        "pointer-nested", "pointer-flat", "pointer-nested-swap", "pointer-flat-swap"}


@pytest.mark.skipif(not triton_outer.HAS_TMA, reason="this Triton has no tensor descriptors")
def test_the_wide_tile_is_timed_on_wide_16_bit_layers_with_tma_loads(monkeypatch):
    """Din = 264 ≥ 256, Dout = 136 ≥ 128 in float16: the wide tile in both loops joins the four variants, is
    timed, and when the clock says it is the fastest it is kept and its result is right. Narrower layers,
    float32 ones and those without TMA loads do not time it."""
    a, d = _inputs(2, 20, 264, 136)
    names = {triton_tune.variant_name(c) for c in triton_tune.candidates(a, d)}
    # the mirror (136 → 264) is too narrow for the wide tile
    assert names == {"pointer-nested", "pointer-flat", "tma-nested", "tma-flat", "tma-overlap",
                     "tma-nested-wide", "tma-flat-wide", "pointer-nested-swap", "pointer-flat-swap",
                     "tma-nested-swap", "tma-flat-swap", "tma-overlap-swap"}
    narrow = _inputs(2, 20, 248, 136)[0]
    assert not any(c[:5] == triton_tune.WIDE for c in triton_tune.candidates(narrow, d))
    assert not any(c[:5] == triton_tune.WIDE for c in triton_tune.candidates(a.float(), d.float()))
    monkeypatch.setattr(triton_tune, "TMA", False)
    assert not any(c[:5] == triton_tune.WIDE for c in triton_tune.candidates(a, d))
    monkeypatch.setattr(triton_tune, "TMA", True)
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    real = triton_tune.timing.elapsed

    def clock(fn, device, repeats=3):
        real(fn, device, 1)
        c = fn.args[3]                                    # a Gram-kernel config has 4 entries
        return 0.0 if len(c) == 7 and triton_tune.variant_name(c) == "tma-flat-wide" else 1.0

    monkeypatch.setattr(triton_tune.timing, "elapsed", clock)
    want = _reference(a, d)
    _close(triton_tune.outer_norms(a, d, True), want)
    assert list(triton_tune.chosen().values()) == ["tma-flat-wide"]
    seen = _count_configs(monkeypatch)
    _close(triton_tune.outer_norms(a, d, True), want)
    assert [c[:5] for c in seen] == [triton_tune.WIDE]


@pytest.mark.skipif(not triton_outer.HAS_TMA, reason="this Triton has no tensor descriptors")
def test_the_deep_k_step_is_timed_on_long_16_bit_layers_with_tma_loads(monkeypatch):
    """T = 130 ≥ 128 (a second K step of two rows: the descriptor pads it), Din = 136, Dout = 144 in float16:
    the K step of 128 joins the variants in the flat loop, in both orientations; when the clock says it is
    the fastest it is kept, and its norms and gradient are right, the examples split over the programs too.
    Shorter examples, narrower layers, float32 and no TMA loads do not time it."""
    a, d = _inputs(2, 130, 136, 144)
    deep = [c for c in triton_tune.candidates(a, d) if c[:5] == triton_tune.DEEP]
    assert [triton_tune.variant_name(c) for c in deep] == ["tma-flat-deep", "tma-flat-deep-swap"]
    for shape in ((2, 127, 136, 144), (2, 130, 120, 144), (2, 130, 136, 120)):
        short = _inputs(*shape)
        assert not any(c[:5] == triton_tune.DEEP for c in triton_tune.candidates(*short)), shape
    assert not any(c[:5] == triton_tune.DEEP for c in triton_tune.candidates(a.float(), d.float()))
    monkeypatch.setattr(triton_tune, "TMA", False)
    assert not any(c[:5] == triton_tune.DEEP for c in triton_tune.candidates(a, d))
    monkeypatch.setattr(triton_tune, "TMA", True)
    want = _reference(a, d)
    assert triton_launch.splits(2, 2 * 2, a.device) == 2             # 4 tiles of 128×128: both examples split
    for config in deep:                              # each orientation, straight from the kernel's wrapper
        _close(triton_outer.outer_norms(a, d, True, config), want)
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    real_forms = triton_tune.forms                   # two of the forms, for a quicker test
    monkeypatch.setattr(triton_tune, "forms", lambda a, d, g, bias=False: {
        n: v for n, v in real_forms(a, d, g, bias).items() if n in ("tma-flat", "tma-flat-deep")})
    real = triton_tune.timing.elapsed

    def clock(fn, device, repeats=3):
        real(fn, device, 1)
        return 0.0 if triton_tune.variant_name(fn.args[3]) == "tma-flat-deep" else 1.0

    monkeypatch.setattr(triton_tune.timing, "elapsed", clock)
    _close(triton_tune.outer_norms(a, d, True), want)
    assert list(triton_tune.chosen().values()) == ["tma-flat-deep"]
    seen = _count_configs(monkeypatch)
    _close(triton_tune.outer_norms(a, d, True), want)
    assert [c[:5] for c in seen] == [triton_tune.DEEP]


def test_the_mirrored_shape_gives_the_same_norms_and_the_gradient_in_place(monkeypatch):
    """A swapped config runs the kernel on (d, a), storing each gradient tile transposed: the same norms,
    and the gradient a contiguous (Dout, Din), also when the examples are split; when the clock says it is the
    fastest, the tuner keeps it. A square layer has no mirror to time."""
    a, d = _inputs(3, 21, 40, 24)
    want = _reference(a, d)
    cfg = triton_outer._config(24, 40, a.dtype)[:5] + (True, False, True)
    n, g = triton_outer.outer_norms(a, d, True, cfg)
    assert g.shape == (24, 40) and g.is_contiguous()
    _close((n, g), want)
    n2, g2 = triton_outer.outer_norms(a, d, False, cfg)
    assert g2 is None
    torch.testing.assert_close(n2, n, rtol=1e-6, atol=0)
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    real = triton_tune.timing.elapsed

    def clock(fn, device, repeats=3):
        real(fn, device, 1)
        c = fn.args[3]
        return 0.0 if len(c) == 8 and triton_tune.variant_name(c) == "pointer-flat-swap" else 1.0

    monkeypatch.setattr(triton_tune.timing, "elapsed", clock)
    _close(triton_tune.outer_norms(a, d, True), want)
    assert list(triton_tune.chosen().values()) == ["pointer-flat-swap"]
    _close(triton_tune.outer_norms(a, d, True), want)
    square = _inputs(2, 9, 32, 32)
    assert not any(len(c) > 7 for c in triton_tune.candidates(*square))


def test_while_a_cuda_graph_is_captured_the_kept_form_runs_and_nothing_is_measured(monkeypatch):
    """A shape measured eagerly (the warm-up before a capture) runs its kept form while a graph is captured
    (where measuring is left out: active() is false), not the fixed variant; a shape first seen while
    capturing runs the fixed variant, measures nothing and keeps nothing."""
    a, d = _inputs(3, 40, 32, 48)
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    want = _reference(a, d)
    triton_tune.outer_norms(a, d, True)                   # measured
    kept = triton_tune.chosen()
    seen = _count_configs(monkeypatch)
    monkeypatch.setattr(triton_tune, "active", lambda a: False)           # as while capturing
    _close(triton_tune.outer_norms(a, d, True), want)
    assert [triton_tune.variant_name(c) for c in seen] == list(kept.values())
    seen.clear()
    a2, d2 = _inputs(2, 9, 16, 24)
    _close(triton_tune.outer_norms(a2, d2, True), _reference(a2, d2))
    assert seen == [None] and triton_tune.chosen() == kept               # fixed variant, nothing measured
    if not INTERPRET:                                     # the real rules on CUDA tensors
        monkeypatch.undo()
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert triton_tune.follows(a) and not triton_tune.active(a)


def test_off_or_untunable_it_runs_the_fixed_variant(monkeypatch):
    a, d = _inputs(2, 9, 16, 24)
    seen = _count_configs(monkeypatch)
    monkeypatch.setattr(triton_tune, "ENABLED", False)
    _close(triton_tune.outer_norms(a, d, True), _reference(a, d))
    assert seen == [None] and triton_tune.tunings() == {}      # no config: FLAT and TMA decide
    monkeypatch.undo()
    # the real rule: CPU tensors are never tuned, nor is anything while torch.compile traces
    assert not triton_tune.active(a.cpu()) and not triton_tune.follows(a.cpu())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not triton_tune.active(a) and not triton_tune.follows(a)


@pytest.mark.skipif(INTERPRET, reason="the default path takes the Triton kernel on CUDA only")
def test_cuda_the_default_path_is_tuned_and_gives_the_untuned_result(monkeypatch):
    """bfloat16 on CUDA: kernels.seq_linear_outer_norms goes through the tuner, which records the shape; its
    result equals the untuned kernel's up to summation order."""
    a, d = _inputs(8, 128, 256, 384, torch.bfloat16)
    assert triton_tune.active(a) and triton_outer.preferred(a, d)
    n, g = kernels.seq_linear_outer_norms(a, d, with_grad=True)
    assert [k[:4] for k in triton_tune.tunings()] == [(8, 128, 256, 384)]
    n0, g0 = triton_outer.outer_norms(a, d, True)
    torch.testing.assert_close(n, n0, rtol=1e-4, atol=0)
    torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-4 * float(g0.abs().max()))


def test_calibration_takes_the_tuners_forms_each_with_its_scratch(monkeypatch):
    """The sequence Linear's calibration candidates (``linear.seq_forms``) are the tuner's forms, named
    ``triton-`` and theirs (one list of forms, not two), and each gives the reference result; its modelled
    scratch is the one of its config (tile, loads, orientation)."""
    from elasticlab.gns.layers import linear

    monkeypatch.setattr(triton_outer, "supported", lambda a: True)     # CPU tensors under the interpreter
    a, d = _inputs(2, 20, 264, 136)
    found = linear.seq_forms(a, d)
    tuned = triton_tune.forms(a, d, True)
    assert {f for f in found if f.startswith("triton-")} == {f"triton-{n}" for n in tuned}
    assert {"triton-tma-flat-wide", "triton-pointer-nested-swap"} <= set(found)
    want = _reference(a, d)
    for name in ("triton-pointer-nested", "triton-tma-flat-wide", "triton-tma-flat-swap",
                 "triton-tma-overlap", "triton-tma-overlap-swap"):
        _close(found[name](), want)
    scratch = linear.seq_scratch(a, d, found)
    assert set(scratch) == set(found)
    B, dout, din = 2, 136, 264
    assert scratch["triton-tma-flat"] == triton_outer.scratch_bytes(B, din, dout, a.device, tma=True,
                                                                      dtype=a.dtype)
    assert scratch["triton-tma-flat-swap"] == triton_outer.scratch_bytes(
        B, dout, din, a.device, triton_outer._config(dout, din, a.dtype)[:5], tma=True)
    wide = triton_outer.scratch_bytes(B, din, dout, a.device, triton_tune.WIDE, tma=True)
    assert scratch["triton-tma-nested-wide"] == wide


@pytest.mark.parametrize("fused", [False, True], ids=["both", "fused"])
def test_bias_sums_are_tuned_as_their_own_key_and_come_from_every_form(monkeypatch, fused):
    """``bias=True`` (a layer with a bias): every timed form returns the per-example bias gradients too, so
    their cost is in each form's time; the shape is tuned under its own key (with the bias sums' way,
    :data:`~elasticlab.gns.triton_outer.FUSE_BIAS`), and the kept form's sums match float64. The fused Gram
    form (Din = Dout = 256 at T = 40) sums them apart. FUSE_BIAS off, each outer form whose tile can sum them
    in the kernel is timed that way too ("-fusedbias"); on, every such form sums them there."""
    monkeypatch.setattr(triton_outer, "FUSE_BIAS", fused)
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    for shape in ((3, 40, 32, 48), (2, 40, 256, 256)):
        a, d = _inputs(*shape)
        want = _reference(a, d)
        n, g, db = triton_tune.outer_norms(a, d, True, bias=True)
        _close((n, g), want, grad_tol=1e-3)
        torch.testing.assert_close(db.double().cpu(), d.double().cpu().sum(1), rtol=1e-5, atol=1e-5)
        found = triton_tune.forms(a, d, True, bias=True)
        outer = triton_tune.candidates(a, d)
        fusable = [c for c in outer if c[0] * c[1] <= 128 * 128 and c[5] != triton_outer.OVERLAP]
        assert fusable                                            # (the 32×48 and 256×256 tiles: all of them)
        fused_names = {n for n in found if n.endswith("-fusedbias")}
        want_fused = {triton_tune.variant_name(c) + "-fusedbias" for c in fusable}
        assert fused_names == (set() if fused else want_fused)
        for name, (call, config) in found.items():
            assert len(call()) == 3, name
            if name.endswith("-fusedbias"):
                assert triton_outer.fuses_bias(config) and config[:len(config) - 2] in [c[:7] for c in outer]
    keys = list(triton_tune.tunings())
    assert [k[-1] for k in keys] == ["fused" if fused else "both"] * 2
    assert "ghost" in triton_tune.tunings()[keys[1]]
    triton_tune.outer_norms(*_inputs(3, 40, 32, 48), True)           # no bias: another key
    assert len(triton_tune.tunings()) == 3 and list(triton_tune.tunings())[-1][-1] is None
    assert not any(n.endswith("-fusedbias") for n in triton_tune.forms(*_inputs(3, 40, 32, 48), True))


def test_a_fused_bias_form_kept_runs_with_the_sums_in_the_kernel(monkeypatch):
    """FUSE_BIAS off (the default): when the clock says a "-fusedbias" form is the fastest, it is kept, and
    later calls run its config, the bias sums from the kernel's δ tiles (BIAS on), matching float64."""
    a, d = _inputs(3, 40, 32, 48)
    want = _reference(a, d)
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    real = triton_tune.timing.elapsed

    def clock(fn, device, repeats=3):
        real(fn, device, 1)
        return 0.0 if triton_tune.variant_name(fn.args[3]) == "pointer-flat-fusedbias" else 1.0

    monkeypatch.setattr(triton_tune.timing, "elapsed", clock)
    triton_tune.outer_norms(a, d, True, bias=True)
    assert list(triton_tune.chosen().values()) == ["pointer-flat-fusedbias"]
    metas, launch = [], triton_launch.launch
    monkeypatch.setattr(triton_launch, "launch", lambda k, grid, dev, args, meta: metas.append(meta)
                        or launch(k, grid, dev, args, meta))
    n, g, db = triton_tune.outer_norms(a, d, True, bias=True)
    _close((n, g), want)
    torch.testing.assert_close(db.double().cpu(), d.double().cpu().sum(1), rtol=1e-5, atol=1e-5)
    assert [m["BIAS"] for m in metas] == [1] and metas[0]["FLAT"] is True


def test_a_choice_saved_and_loaded_runs_its_config_without_timing(monkeypatch, tmp_path):
    """elasticlab.gns.choices: a shape tuned, saved, forgotten and loaded back (as a rerun or another rank
    would) runs the kept variant, once, and times nothing."""
    from elasticlab.gns import choices
    a, d = _inputs(3, 40, 32, 48)
    monkeypatch.setattr(triton_tune, "REPEATS", 1)
    want = _reference(a, d)
    triton_tune.outer_norms(a, d, True)
    kept = triton_tune.kept()
    choices.save(tmp_path / "c.json")
    triton_tune.reset()
    assert choices.load(tmp_path / "c.json", device=a.device) == 1
    assert triton_tune.kept() == kept
    seen = _count_configs(monkeypatch)
    _close(triton_tune.outer_norms(a, d, True), want)
    (name, config), = kept.values()
    assert seen == [config] and triton_tune.variant_name(config) == name
