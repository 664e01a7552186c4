"""The baselines of benchmarks/bench_psgnorm.py that the GPU run compares against: Opacus ghost clipping on a
model with in-place ReLUs (G2's torchvision ResNet-18, where it raised in session 10)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCH)
    try:
        import bench_psgnorm
        yield bench_psgnorm
    finally:
        sys.path.remove(BENCH)


def _cnn(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(inplace=inplace),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=inplace), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 5))


def test_out_of_place_turns_every_in_place_activation_off_and_keeps_the_values(bench):
    model, x = _cnn(inplace=True), torch.randn(4, 3, 8, 8)
    want = model(x.clone())
    assert bench.out_of_place(model) == 2
    assert not any(getattr(m, "inplace", False) for m in model.modules())
    torch.testing.assert_close(model(x), want)
    assert bench.out_of_place(model) == 0


def test_opacus_ghost_gives_the_norms_of_a_model_with_in_place_relus(bench):
    """The bench's ``opacus-ghost`` step on the in-place CNN: Opacus's squared norms equal elasticlab's
    reference (torch.func, float64)."""
    pytest.importorskip("opacus")
    from elasticlab.gns.reference import func_sq_norms
    model = _cnn(inplace=True).double()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (4,))
    want = func_sq_norms(_cnn(inplace=False).double(), bench.loss_fn, x, y)
    step = bench.make_step("opacus-ghost", model, x, y)
    try:
        got = step()
    finally:
        bench.close(step)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_rounds_measure_every_entry_again_and_report_the_spread(bench, capsys):
    """``--rounds 2``: each entry is timed twice, round-robin (keys W1-fp32 and W1-fp32#2), and each method's
    ratios over the rounds are printed and kept under "rounds"; ``--rounds 0`` is an error that names it."""
    import json

    assert bench.main(["--workloads", "W1", "--methods", "plain,psgn", "--quick", "--no-memory",
                       "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1][len("RESULT "):])
    assert set(res["workloads"]) == {"W1-fp32", "W1-fp32#2"}
    runs = res["workloads"]
    assert res["rounds"]["W1-fp32"]["psgn"] == [runs[k]["ratio"]["psgn"] for k in ("W1-fp32", "W1-fp32#2")]
    assert "rounds (ratio to plain in each round" in out and "median" in out
    with pytest.raises(SystemExit, match="--rounds must be at least 1, got 0"):
        bench.main(["--workloads", "W1", "--rounds", "0"])


def test_switched_methods_are_paired_with_psgn_round_by_round(bench, capsys):
    """A ``psgn-…`` method's time over psgn's in each round where both ran, and in how many it was faster:
    the rule for turning a switch on (faster in every round). Methods that are not psgn's switches, and
    rounds without psgn, are left out."""
    runs = [{"ratio": {"psgn": 1.20, "psgn-fusedbias": 1.14, "torch.func": 3.0}},
            {"ratio": {"psgn": 1.10, "psgn-fusedbias": 1.21}},
            {"ratio": {"psgn-fusedbias": 1.0}},
            {"ratio": {"psgn": 1.30, "psgn-fusedbias": 1.17, "psgn-chunkshare": 1.30}}]
    got = bench.against_psgn(runs)
    assert set(got) == {"psgn-fusedbias", "psgn-chunkshare"}
    paired, wins = got["psgn-fusedbias"]
    assert paired == pytest.approx([0.95, 1.1, 0.9]) and wins == 2
    assert got["psgn-chunkshare"] == ([1.0], 0)                   # equal is not faster
    workloads = {"G3-bf16": runs[0], "G3-bf16#2": runs[1], "G3-bf16#3": runs[3]}
    bench.print_rounds(workloads, [("G3", "bf16")])
    assert "psgn-fusedbias   / psgn 0.950 1.100 0.900   faster in 2 of 3 rounds" in capsys.readouterr().out


def test_compiled_methods_give_psgn_norms(bench, monkeypatch):
    """psgn-compiled (the model under torch.compile, here with aot_eager for speed) gives psgn's norms on a
    shrunken W2; plain-compiled runs and gives none."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="aot_eager"))
    torch._dynamo.reset()
    model, x, y = bench.workload("W2", check=True)
    model = model.double()
    x = x.double()
    ref = bench.make_step("psgn", model, x, y)
    want = ref()
    ref.close()
    step = bench.make_step("psgn-compiled", model, x, y)
    try:
        for _ in range(2):
            got = step()
    finally:
        step.close()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    assert bench.make_step("plain-compiled", model, x, y)() is None


def test_graphed_methods_are_skipped_off_cuda_with_the_reason(bench, capsys):
    """plain-graphed and psgn-graphed (the step captured in a CUDA graph) need a CUDA device: on the CPU each
    is listed as skipped, with no check error and no timing, and make_step says why."""
    import json

    assert bench.main(["--workloads", "W1", "--methods", "plain,psgn,plain-graphed,psgn-graphed", "--quick",
                       "--no-memory"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1][len("RESULT "):])["workloads"]["W1-fp32"]
    for m in ("plain-graphed", "psgn-graphed"):
        assert res["skipped"][m] == "CUDA graphs need a CUDA device"
        assert m not in res["ms"] and m not in res["errors"] and m not in res["check_rel_err"]
    assert "psgn" in res["ratio"] and "graphed_ratio" not in res
    model, x, y = bench.workload("W1", check=True)
    with pytest.raises(bench.Unavailable, match="CUDA graphs need a CUDA device"):
        bench.make_step("psgn-graphed", model, x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_cuda_graphed_psgn_gives_the_eager_norms(bench, prec):
    """psgn-graphed on CUDA (W2's block, shrunken): its replays return the eager step's norms, and the
    replayed gradients are the eager ones; plain-graphed runs and gives none."""
    dev = torch.device("cuda")
    model, x, y = bench.workload("W2", check=True)
    model, x, y = model.to(dev), x.to(dev), y.to(dev)
    ref = bench.make_step("psgn", model, x, y, prec)
    want = ref().clone()
    grads = [p.grad.clone() for p in model.parameters()]
    ref.close()
    step = bench.make_step("psgn-graphed", model, x, y, prec)
    try:
        for _ in range(2):
            got = step()
        torch.cuda.synchronize()
    finally:
        step.close()
    tol = dict(rtol=1e-4, atol=0) if prec == "fp32" else dict(rtol=2e-2, atol=0)
    torch.testing.assert_close(got, want, **tol)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-3 if prec == "fp32" else 2e-2,
                                   atol=1e-5 * float(g.abs().max()))
    plain = bench.make_step("plain-graphed", model, x, y, prec)
    assert plain() is None
