"""The CUDA operator benchmarks' forms, run small on the CPU before a GPU session spends its minutes on them:
every form that ``benchmarks/bench_seq_linear_cuda.py`` and ``bench_conv_cuda.py`` would time gives the
float64 reference's norms and the weight gradient. The Triton forms run in CI's interpreter step
(``.ci/triton_interpret.sh``, float16), the ``_C`` operators in the main test run."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from elasticlab.gns import kernels, triton_launch, triton_outer, triton_tune

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
DTYPES = [torch.float32, torch.float16 if triton_launch.INTERPRETED else torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH)                     # bench_conv_cuda imports bench_seq_linear_cuda
    try:
        import bench_conv_cuda
        import bench_seq_linear_cuda
        yield bench_seq_linear_cuda, bench_conv_cuda
    finally:
        sys.path.remove(BENCH)


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_sequence_linear_methods_give_the_reference_norms(bench, dt):
    seq, _ = bench
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 40, generator=g).to(dt)
    d = (torch.randn(3, 5, 24, generator=g) / 5 ** 0.5).to(dt)
    meth = seq.methods(a, d)
    want = {"bmm"} | ({"cublas", "gram"} if kernels.compiled("seq_linear_outer_norms", a) else set()) \
        | ({"triton", "flat", "ghost", "tuned"} if triton_outer.HAS_TRITON else set()) \
        | ({"tma", "tma-flat"} if triton_outer.HAS_TMA else set())                  # 40, 24: aligned rows
    assert set(meth) == want
    ref_norms, ref_grad = kernels.seq_linear_outer_norms_ref(a.double(), d.double(), True)
    for m, err in seq.rel_errors(meth, a, d).items():
        assert err < TOL[dt], (m, err)
    for m, f in meth.items():
        out = f()
        if m == "bmm":
            grad = out[0].double().sum(0)
        else:
            torch.testing.assert_close(out[0].double(), ref_norms, rtol=TOL[dt], atol=0, msg=m)
            grad = out[1].double()
        torch.testing.assert_close(grad, ref_grad, rtol=TOL[dt], atol=TOL[dt] * ref_grad.abs().max().item(),
                                   msg=m)


def _kernel_case(B, T, Din, Dout, seed):
    """(a, d, (float64 norms, gradient)) in float16 where the Triton kernels run (skips elsewhere)."""
    dev = triton_launch.kernel_device()
    if dev is None:
        pytest.skip("needs a CUDA device or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, T, Din, generator=g).to(dev, DTYPES[1])
    d = (torch.randn(B, T, Dout, generator=g) / T ** 0.5).to(dev, DTYPES[1])
    return a, d, kernels.seq_linear_outer_norms_ref(a.double().cpu(), d.double().cpu(), True)


@pytest.mark.skipif(not triton_outer.HAS_TRITON, reason="the fused Gram kernel needs Triton")
def test_every_config_of_the_gram_sweep_gives_the_reference_norms(bench):
    """``GHOST_SWEEP``'s configs (those ``triton_tune`` times among them) on a sequence of three blocks of the
    smallest one (T = 150): diagonal and off-diagonal pairs, the last block cut at T, K loops cut at Din."""
    seq, _ = bench
    a, d, (ref, _) = _kernel_case(2, 150, 72, 40, seed=1)
    assert len(seq.GHOST_SWEEP["configs"]) >= 2
    for cfg in seq.GHOST_SWEEP["configs"]:
        norms, _ = seq.triton_tune.ghost(a, d, False, cfg)
        torch.testing.assert_close(norms.double().cpu(), ref, rtol=2e-5, atol=0, msg=str(cfg))


@pytest.mark.skipif(not triton_outer.HAS_TRITON, reason="the outer kernel needs Triton")
def test_every_config_of_the_tile_sweep_gives_the_reference_norms_and_gradient(bench):
    """``SWEEP``'s tiles (the tuner's wide one among them), both loops and both loads, on a layer that cuts
    every tile at its edges (Din = 264, Dout = 136; T = 70 off each K step)."""
    seq, _ = bench
    a, d, (ref, ref_grad) = _kernel_case(2, 70, 264, 136, seed=2)
    configs = seq.SWEEP["configs"]
    assert any(c[:5] == triton_tune.WIDE for c in configs) == bool(seq.triton_tune.TMA)
    for cfg in configs:
        norms, grad = triton_outer.outer_norms(a, d, True, cfg)
        torch.testing.assert_close(norms.double().cpu(), ref, rtol=2e-5, atol=0, msg=str(cfg))
        torch.testing.assert_close(grad.double().cpu(), ref_grad, rtol=2e-5,
                                   atol=2e-5 * ref_grad.abs().max().item(), msg=str(cfg))


@pytest.mark.skipif(not triton_outer.HAS_TMA, reason="the plain Triton GEMM loads through TMA descriptors")
def test_the_plain_triton_gemm_of_the_sweep_is_the_weight_gradient(bench):
    """The sweep's ``triton-gemm`` baseline (the weight-gradient GEMM alone, in Triton) in each TMA tile of
    the sweep gives the float64 weight gradient (edges cut on both sides, B·T = 140 off the K step)."""
    seq, _ = bench
    a, d, (_, ref_grad) = _kernel_case(2, 70, 264, 136, seed=3)
    tiles = sorted({c[:5] for c in seq.SWEEP["configs"] if c[6]})
    assert triton_tune.WIDE in tiles
    for tile in tiles:
        torch.testing.assert_close(seq.triton_wgrad(a, d, tile).double().cpu(), ref_grad, rtol=2e-5,
                                   atol=2e-5 * ref_grad.abs().max().item(), msg=str(tile))


def test_sequence_linear_head_leaves_out_the_gram_form(bench):
    seq, _ = bench
    a, d = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    assert "gram" not in seq.methods(a, d, "G1.head")


@pytest.mark.parametrize("name", ["G2.conv1", "G2.l2a", "G2.l2ds", "G2.l4", "W4.c1"])
def test_convolution_forms_give_the_reference_norms(bench, name):
    _, conv = bench
    dt = DTYPES[1] if conv.LAYERS[name][7] != torch.float32 else torch.float32
    forms, wgrad, ref, (L, _) = conv.forms_of(name, "cpu", batch=2, dtype=dt)
    assert {"patches", "grouped", "gram"} <= set(forms)
    assert ("triton" in forms) == triton_outer.HAS_TRITON
    assert ("triton-k32" in forms) == (triton_outer.HAS_TRITON and L > 32)     # K steps of 64 there
    gw = wgrad().double()
    for f, fn in forms.items():
        norms, grad = fn()
        torch.testing.assert_close(norms[:2].double(), ref, rtol=TOL[dt], atol=0, msg=f)
        torch.testing.assert_close(grad.double().reshape(gw.shape), gw, rtol=TOL[dt],
                                   atol=TOL[dt] * gw.abs().max().item(), msg=f)


@pytest.mark.skipif(not triton_outer.HAS_TRITON, reason="the outer kernel needs Triton")
def test_the_split_sweep_gives_the_reference_at_one_and_two_programs_per_sm(bench, monkeypatch):
    """``per-sm-1`` and ``per-sm-2`` (``triton_launch.PROGRAMS_PER_SM``): the examples split in other numbers
    of groups (here 4 and 6 on the interpreter's 4 "SMs" with one tile), the same norms and gradient."""
    seq, _ = bench
    a, d, (ref, ref_grad) = _kernel_case(6, 70, 64, 100, seed=4)
    got = set()
    for p in (1, 2):
        monkeypatch.setattr(triton_launch, "PROGRAMS_PER_SM", p)
        got.add(triton_launch.splits(6, 1, a.device))
        for cfg in seq.SPLIT_CONFIGS:
            if cfg[6] and not triton_outer.tma_ok(a, d):
                continue
            norms, grad = triton_outer.outer_norms(a, d, True, cfg)
            torch.testing.assert_close(norms.double().cpu(), ref, rtol=2e-5, atol=0, msg=str((p, cfg)))
            torch.testing.assert_close(grad.double().cpu(), ref_grad, rtol=2e-5,
                                       atol=2e-5 * ref_grad.abs().max().item(), msg=str((p, cfg)))
    assert len(got) == 2


def test_the_split_sweep_times_each_setting_where_the_splits_differ(bench, monkeypatch, capsys):
    """``sweep_split`` on a 132-SM GPU (its timing stubbed): G3.up's wide tile (128 tiles) splits in 1 or 2,
    so both lines time it, with PROGRAMS_PER_SM set during each and put back after; G3.up's 128×128 tile
    (256 tiles) splits in 1 either way and is left out; G1.head (2358 tiles) gives no lines."""
    seq, _ = bench
    monkeypatch.setattr(triton_launch, "sm_count", lambda dev: 132)
    monkeypatch.setattr(seq.triton_tune, "TMA", True)
    seen = []

    def fake(name, iters, configs, form):
        seen.append((triton_launch.PROGRAMS_PER_SM, [c[:5] for c in configs]))
        return {str(c): 1.0 + triton_launch.PROGRAMS_PER_SM / 10 for c in configs}
    monkeypatch.setattr(seq, "_sweep_layer", fake)
    out = seq.sweep_split("G3.up", 1)
    wide = str(triton_tune.WIDE + (True, True))
    assert seen == [(1, [triton_tune.WIDE]), (2, [triton_tune.WIDE])]
    assert out == {f"per-sm 1 {wide}": 1.1, f"per-sm 2 {wide}": 1.2}
    assert triton_launch.PROGRAMS_PER_SM == 2
    text = capsys.readouterr().out
    assert "per-sm-1      tma-flat-wide(split 1) 1.10x" in text and "tma-flat-wide(split 2) 1.20x" in text
    seen.clear()
    assert seq.sweep_split("G1.head", 1) == {} and seen == []


def test_the_sweep_prints_the_l2_bandwidth_each_tma_flat_launch_drew(bench, monkeypatch, capsys):
    """``operand_bytes``: G3.up's 128×128 tile, 32 × 8 programs each loading 256 bf16 values a row for
    64 × 512 rows, is 2³² B; the wide tile 3/4 of that. ``sweep_triton`` (its timing stubbed: the GEMM
    0.5 ms, each config 1.25× or 2×) prints those bytes over each TMA flat config's time, in TB/s, and the
    errors as they are."""
    seq, _ = bench
    assert seq.operand_bytes("G3.up", (128, 128, 64, 8, 4)) == 2 ** 32
    assert seq.operand_bytes("G3.up", triton_tune.WIDE) == 3 * 2 ** 30
    assert seq.operand_bytes("G3.down", (128, 128, 64, 8, 4)) == 2 ** 32        # the same loads, mirrored
    monkeypatch.setattr(seq.triton_tune, "TMA", True)
    monkeypatch.setattr(seq, "SWEEP", {"layers": ["G3.up"], "configs": [
        (128, 128, 64, 8, 4, True, True), seq.triton_tune.WIDE + (True, True),
        (128, 128, 128, 8, 3, True, True), (128, 128, 64, 8, 4, False, True),
        (128, 128, 64, 8, 4, True, True, True)]})

    def fake(name, iters, configs, form):
        seq.WGRAD_MS[name] = 0.5
        ratio = {0: 1.25, 1: 2.0, 2: "error: OutOfResources"}
        return {str(c): ratio.get(i, 3.0) for i, c in enumerate(configs)}
    monkeypatch.setattr(seq, "_sweep_layer", fake)
    monkeypatch.setattr(seq, "sweep_bias", lambda name, iters: {})
    monkeypatch.setattr(seq, "sweep_split", lambda name, iters: {})
    seq.sweep_triton(1)
    line, = [ln for ln in capsys.readouterr().out.splitlines() if "tma-flat TB/s" in ln]
    # 2³² B in 0.625 ms; 3·2³⁰ B in 1 ms; the error; not the nested loop nor the mirrored launch
    assert line.split("TB/s")[1].split() == [
        "128x128x64/8/4", f"{2 ** 32 / 0.625e-3 / 1e12:.1f}",
        "128x256x64/8/3", f"{3 * 2 ** 30 / 1e-3 / 1e12:.1f}", "128x128x128/8/3", "error:", "OutOfResources"]


@pytest.mark.skipif(not triton_outer.HAS_TRITON, reason="the L2 read kernel is a Triton kernel")
def test_the_l2_read_kernel_reads_every_block_once_a_pass(bench):
    """``l2_read`` (the ceiling of the sweep's TB/s lines): 5 programs over 7 blocks of 64 values, 3 passes:
    program p sums blocks p, p + 5, … of the 21 block reads, so the rows add up to 3 × x's block sum, and
    program 0's row is blocks 0, 5, 3 (10 mod 7), 1 (15 mod 7) and 6 (20 mod 7)."""
    seq, _ = bench
    dev = triton_launch.kernel_device() or pytest.skip("needs a CUDA device or TRITON_INTERPRET=1")
    x = torch.randn(7 * 64, generator=torch.Generator().manual_seed(5)).to(dev, DTYPES[1])
    out = seq.l2_read(x, passes=3, programs=5, block=64).double().cpu()
    blocks = x.double().cpu().view(7, 64)
    torch.testing.assert_close(out.sum(0), 3 * blocks.sum(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0], blocks[[0, 5, 3, 1, 6]].sum(0), rtol=1e-6, atol=1e-6)


def test_an_l2_ceiling_that_fails_to_measure_is_reported_not_raised(bench, monkeypatch):
    seq, _ = bench

    def broken(iters):
        raise RuntimeError("no such kernel\nmore")
    monkeypatch.setattr(seq, "l2_read_rate", broken)
    assert seq._l2_ceiling(3) == "error: RuntimeError: no such kernel"
    assert seq._num(seq._l2_ceiling(3)) == "error: RuntimeError: no such kernel" and seq._num(9.87) == "9.9"
