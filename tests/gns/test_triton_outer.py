"""The Triton fused outer-product kernel itself (``elasticlab.gns.triton_outer``) against float64.

It runs where Triton can run it: on a CUDA device, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported). CI runs this module that way in the torch build
that ships Triton (``.ci/triton_interpret.sh``); ``make test``'s CPU torch has no Triton and skips it.
The interpreter has no bfloat16 (numpy has none), so bfloat16 is checked on CUDA only
(``test_kernels.py::test_cuda_triton_fused_outer_matches_float64``); float16 and float32 run both ways.
Shapes are chosen to cover what the kernel's grid does: tiles cut at the layer's edges in both directions, T
not a multiple of the K step, a single row or column, examples split over the second grid axis, strided
(non-contiguous) inputs, and the norms-only launch; each in both loop structures of the kernel (``flat``: one
loop over (example, K step) pairs; nested: a K loop per example).
"""
import pytest
import torch

from elasticlab.gns import kernels, triton_launch, triton_outer, triton_tune

DEV = triton_launch.kernel_device() or pytest.skip(
    "the Triton kernels need Triton and a CUDA device, or TRITON_INTERPRET=1", allow_module_level=True)
INTERPRET = triton_launch.INTERPRETED
pytestmark = [] if INTERPRET else [pytest.mark.gpu]      # on a GPU: part of gpu_check's ``pytest -m gpu``
DTYPES = triton_launch.kernel_dtypes()

# (B, T, Din, Dout, config): config None = the kernel's own choice; small tiles make many tiles and splits
CASES = [
    (3, 70, 40, 130, None),                 # T past one K step, Dout over a 128-row tile's edge
    (2, 1, 1, 5, None),                     # T = 1, Din = 1
    (5, 33, 70, 20, (32, 32, 16, 4, 2)),    # several tiles in both directions, edges cut, B > split
    (9, 16, 48, 64, (32, 32, 16, 4, 2)),    # 4 tiles on a 4-SM "device": examples split over 2 groups
]


def _inputs(B, T, Din, Dout, dtype, strided=False):
    g = torch.Generator().manual_seed(B * 1000 + T)
    a = torch.randn(B, T, Din + (3 if strided else 0), generator=g).to(DEV, dtype)
    d = (torch.randn(B, T, Dout, generator=g) / T ** 0.5).to(DEV, dtype)
    if strided:
        a = a[..., 1:Din + 1]                           # row stride Din + 3: not contiguous
    return a, d


def _check(a, d, config, with_grad=True):
    n, g = triton_outer.outer_norms(a, d, with_grad, config)
    # the float64 reference of the same (already rounded) inputs
    rn, rg = kernels.seq_linear_outer_norms_ref(a.double().cpu(), d.double().cpu(), with_grad=True)
    assert n.dtype == torch.float32 and n.shape == (a.shape[0],)
    tol = dict(rtol=2e-5, atol=1e-6 * float(rn.max()))
    torch.testing.assert_close(n.double().cpu(), rn, **tol)
    if with_grad:
        assert g.dtype == torch.float32 and g.shape == (d.shape[2], a.shape[2])
        torch.testing.assert_close(g.double().cpu(), rg, rtol=2e-5, atol=2e-5 * float(rg.abs().max()))
    else:
        assert g is None
    return n


def _spy_launches(monkeypatch, kernel: str) -> list:
    """The grid of each launch of ``triton_outer.<kernel>`` from now on (the kernel still runs)."""
    launches, real = [], getattr(triton_outer, kernel)

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_outer, kernel, Spy())
    return launches


def _with_loop(config, Din, Dout, flat, dtype=None):
    return (config or triton_outer._config(Din, Dout, dtype))[:5] + (flat,)


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,Din,Dout,config", CASES)
def test_fused_outer_norms_match_float64(B, T, Din, Dout, config, dtype, flat):
    a, d = _inputs(B, T, Din, Dout, dtype)
    config = _with_loop(config, Din, Dout, flat, dtype)
    n = _check(a, d, config)
    # norms only (no gradient buffer, WITH_GRAD off): the same norms
    torch.testing.assert_close(_check(a, d, config, with_grad=False), n, rtol=1e-6, atol=0)


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs(dtype, flat):
    a, d = _inputs(4, 20, 24, 36, dtype, strided=True)
    assert not a.is_contiguous()
    _check(a, d, (32, 32, 16, 4, 2, flat))


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_the_loop_switch_chooses_the_kernel_loop(monkeypatch, flat):
    """Without a loop in ``config`` the kernel takes :data:`triton_outer.FLAT`'s, and :func:`_config` reports
    it: both loops give the same norms and gradient."""
    monkeypatch.setattr(triton_outer, "FLAT", flat)
    assert triton_outer._config(256, 256)[5] is flat
    a, d = _inputs(6, 37, 40, 24, torch.float32)
    n, g = triton_outer.outer_norms(a, d, True, (32, 32, 16, 4, 2))
    n2, g2 = triton_outer.outer_norms(a, d, True, (32, 32, 16, 4, 2, not flat))
    torch.testing.assert_close(n, n2, rtol=1e-5, atol=0)
    torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-6)


# aligned for TMA descriptors (Din, Dout multiples of 8): edges cut, T off the K step, examples split
TMA_CASES = [
    (3, 70, 40, 136, None),
    (5, 33, 72, 24, (32, 32, 16, 4, 2)),
    (9, 16, 48, 64, (32, 32, 16, 4, 2)),
    (2, 70, 264, 136, triton_tune.WIDE),             # the tuner's wide tile, both edges cut
]


@pytest.mark.skipif(not triton_outer.HAS_TMA, reason="this Triton has no tensor descriptors")
@pytest.mark.parametrize("flat", [False, True, triton_outer.OVERLAP], ids=["nested", "flat", "overlap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,Din,Dout,config", TMA_CASES)
def test_tma_kernel_matches_float64(monkeypatch, B, T, Din, Dout, config, dtype, flat):
    """The TMA form (:func:`triton_outer._outer_norms_tma_kernel`: descriptor loads with zero fill past T,
    a partial norm per gradient row) against float64, its three loops (the overlapped one: each example's
    epilogue in the next one's first K step, the last one's after the loop; one example a program where the
    examples are split), with and without the gradient; it is the kernel launched (spied), and it gives the
    pointer kernel's norms (whose loops are two: the overlapped one needs TMA)."""
    launched = _spy_launches(monkeypatch, "_outer_norms_tma_kernel")
    a, d = _inputs(B, T, Din, Dout, dtype)
    assert triton_outer.tma_ok(a, d)
    cfg = _with_loop(config, Din, Dout, flat, dtype)
    n = _check(a, d, cfg + (True,))
    torch.testing.assert_close(_check(a, d, cfg + (True,), with_grad=False), n, rtol=1e-6, atol=0)
    assert len(launched) == 2
    pointer = cfg[:5] + (bool(flat),)
    torch.testing.assert_close(_check(a, d, pointer + (False,)), n, rtol=1e-5, atol=0)
    assert len(launched) == 2                                   # tma=False: the pointer kernel
    if flat == triton_outer.OVERLAP:
        with pytest.raises(ValueError, match="overlapped loop needs TMA"):
            triton_outer.outer_norms(a, d, True, cfg + (False,))
        with pytest.raises(ValueError, match="loop must be False"):
            triton_outer.outer_norms(a, d, True, cfg[:5] + (3, True))


@pytest.mark.skipif(not triton_outer.HAS_TMA, reason="this Triton has no tensor descriptors")
def test_tma_switch_falls_back_where_descriptors_cannot_address_the_operands(monkeypatch):
    """With :data:`triton_outer.TMA` on, rows whose byte length is not a multiple of 16 (fp16 Dout = 130)
    and views with an odd offset take the pointer kernel, and still give the float64 norms."""
    monkeypatch.setattr(triton_outer, "TMA", True)
    a, d = _inputs(3, 20, 40, 130, torch.float16)
    assert not triton_outer.tma_ok(a, d)
    _check(a, d, None)
    a, d = _inputs(3, 20, 41, 24, torch.float16)
    a = a[..., 1:]                                              # base 2 bytes past an aligned one
    assert a.shape[2] == 40 and not triton_outer.tma_ok(a, d)
    _check(a, d, None)
    a, d = _inputs(3, 20, 40, 24, torch.float16)
    assert triton_outer.tma_ok(a, d) and not triton_outer.tma_ok(a.double(), d.double())
    _check(a, d, None)


def test_the_examples_are_split_when_the_tiles_are_few(monkeypatch):
    """With one tile and 7 examples on a 4-SM device the kernel runs 7 programs, each summing its own
    examples' gradient slice (the slices then summed): the result is the same as one program's."""
    launches = _spy_launches(monkeypatch, "_outer_norms_kernel")
    a, d = _inputs(7, 9, 16, 16, torch.float32)
    n = _check(a, d, (32, 32, 16, 4, 2))
    assert launches[-1] == (1, 7)
    monkeypatch.setattr(triton_launch, "sm_count", lambda dev: 0)         # one group: no split
    torch.testing.assert_close(_check(a, d, (32, 32, 16, 4, 2)), n, rtol=1e-6, atol=0)
    assert launches[-1] == (1, 1)


@pytest.mark.parametrize("allow_tf32,want", [(False, "ieee"), (True, "tf32")])
def test_float32_products_are_exact_unless_tf32_is_allowed(allow_tf32, want):
    before = torch.backends.cuda.matmul.allow_tf32          # (a property of torch's cuBLAS settings)
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        assert triton_launch.precision(torch.float32) == want
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert triton_launch.precision(torch.bfloat16) == "tf32"      # Triton's default; half inputs are exact


def test_empty_inputs():
    a, d = _inputs(2, 3, 4, 5, torch.float32)
    n, g = triton_outer.outer_norms(a[:, :0], d[:, :0], True)
    assert n.tolist() == [0.0, 0.0] and g.shape == (5, 4) and not g.any()


@pytest.mark.skipif(INTERPRET, reason="the layers send CUDA tensors only to the fused kernel")
def test_float32_model_norms_with_the_fused_kernel_match_cublas(monkeypatch):
    """triton_outer.FP32 on: a float32 sequence model's Linear layers take the fused kernel (exact float32
    products); its norms and gradients match the cuBLAS path's."""
    from torch import nn

    from elasticlab.gns import PerSampleGradNorms

    calls = []
    real = triton_outer.outer_norms
    monkeypatch.setattr(triton_outer, "outer_norms", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.backends.cuda.matmul.allow_tf32 = False
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    x = torch.randn(6, 100, 64, device="cuda")
    out = {}
    for fp32 in (False, True):
        triton_outer.FP32 = fp32
        try:
            model.zero_grad(set_to_none=True)
            with PerSampleGradNorms(model) as psg:
                model(x).pow(2).mean().backward()
                out[fp32] = (psg.sq_norms(), [p.grad.clone() for p in model.parameters()])
        finally:
            triton_outer.FP32 = False
        assert len(calls) == (2 if fp32 else 0)                          # both Linear layers, then none
    assert triton_outer.takes(x, 100, 64, 256) is False                  # off again
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-4, atol=0)
    for g1, g0 in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)


def _nan_outputs(monkeypatch) -> None:
    """Every buffer the kernels write beyond the norms and gradient starts as NaN from now on, so that an
    entry no program writes shows (a fresh CPU allocation is often zeros)."""
    real = triton_outer.run_tiles

    def spy(*args, outputs=(), **kw):
        for t in outputs:
            if t is not None:
                t.fill_(float("nan"))
        return real(*args, outputs=outputs, **kw)
    monkeypatch.setattr(triton_outer, "run_tiles", spy)


LOOP_FORMS = [(False, False), (True, False), (False, True), (True, True), (triton_outer.OVERLAP, True)]


@pytest.mark.parametrize("swap", [False, True], ids=["rows", "mirrored"])
@pytest.mark.parametrize("loop,tma", LOOP_FORMS,
                         ids=["pointer-nested", "pointer-flat", "tma-nested", "tma-flat", "tma-overlap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,Din,Dout", [(9, 20, 48, 24), (5, 37, 72, 40)])
def test_bias_gradients_summed_in_the_kernel_match_float64(monkeypatch, B, T, Din, Dout, dtype, loop, tma,
                                                           swap):
    """``bias=True``: each example's Σ_t δ_{b,t}, summed by the programs from the δ tiles they load (each
    example's by one program of its row of tiles, or of its column in the mirrored launch), against float64;
    every entry written (NaN-filled buffer), with and without the gradient, norms and gradient unchanged.
    Shapes: 2 tiles on a 4-SM device (the examples split into 4 groups of 2-3, each group's examples owned in
    turn by the 2 programs), and 6 tiles cut at both edges, one group."""
    if tma and not triton_outer.HAS_TMA:
        pytest.skip("this Triton has no tensor descriptors")
    _nan_outputs(monkeypatch)
    monkeypatch.setattr(triton_outer, "FUSE_BIAS", True)
    a, d = _inputs(B, T, Din, Dout, dtype)
    cfg = (32, 32, 16, 4, 2, loop, tma, swap)
    # the overlapped loop's three float32 tiles leave no registers for them: summed apart
    assert triton_outer.fuses_bias(cfg) is (loop != triton_outer.OVERLAP)
    want = d.double().cpu().sum(1)
    n0, g0 = triton_outer.outer_norms(a, d, True, cfg)
    for with_grad in (True, False):
        n, g, db = triton_outer.outer_norms(a, d, with_grad, cfg, bias=True)
        assert db.dtype == torch.float32 and db.shape == (B, Dout)
        torch.testing.assert_close(db.double().cpu(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        torch.testing.assert_close(n, n0, rtol=1e-6, atol=0)
        if with_grad:
            torch.testing.assert_close(g, g0, rtol=1e-6, atol=0)
        else:
            assert g is None


def test_bias_sums_apart_and_empty_inputs(monkeypatch):
    """:data:`triton_outer.FUSE_BIAS` off (the default) or a tile over 128×128: the bias sums by ``d.sum(1)``
    after a kernel launched without them, the same values; inputs with no positions: zero bias gradients."""
    metas, real = [], triton_outer._outer_norms_kernel

    class Spy:                                                  # each launch's compile-time constants
        def __getitem__(self, grid):
            return lambda *args, **meta: metas.append(meta) or real[grid](*args, **meta)
    monkeypatch.setattr(triton_outer, "_outer_norms_kernel", Spy())
    a, d = _inputs(4, 21, 40, 24, torch.float32)
    monkeypatch.setattr(triton_outer, "FUSE_BIAS", True)
    n, g, db = triton_outer.outer_norms(a, d, True, (32, 32, 16, 4, 2, True), bias=True)
    assert not triton_outer.fuses_bias((128, 256, 64, 8, 3, True))
    monkeypatch.setattr(triton_outer, "FUSE_BIAS", False)
    assert not triton_outer.fuses_bias((32, 32, 16, 4, 2, True))
    n2, g2, db2 = triton_outer.outer_norms(a, d, True, (32, 32, 16, 4, 2, True), bias=True)
    assert [m["BIAS"] for m in metas] == [1, 0]
    torch.testing.assert_close(db, db2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(n, n2, rtol=0, atol=0)
    monkeypatch.setattr(triton_outer, "FUSE_BIAS", True)
    n, g, db = triton_outer.outer_norms(a[:, :0], d[:, :0], True, bias=True)
    assert db.shape == (4, 24) and not db.any() and not n.any()
