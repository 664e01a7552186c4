"""The GPU idle-gap analysis of benchmarks/profile_psgnorm.py, on made-up kernel intervals, and the script's
CPU smoke run."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")


@pytest.fixture(scope="module")
def prof_mod():
    sys.path.insert(0, BENCH)                     # the script imports bench_psgnorm from its folder
    try:
        path = os.path.join(BENCH, "profile_psgnorm.py")
        spec = importlib.util.spec_from_file_location("profile_psgnorm", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(BENCH)


def test_idle_is_the_span_less_the_union_of_overlapping_kernels(prof_mod):
    # µs: a [0,10] with b [5,20] nested-overlapping, c [8,12] inside both, gap 20->30 before d, d [30,31],
    # gap 31->100 before e, e [100,150]; two steps
    ivs = [(30, 31, "d"), (0, 10, "a"), (5, 20, "b"), (8, 12, "c"), (100, 150, "e")]
    r = prof_mod.idle_gaps(ivs, steps=2, k=5)
    assert r["span_ms_per_step"] == pytest.approx(150 / 1e3 / 2)
    assert r["idle_ms_per_step"] == pytest.approx((10 + 69) / 1e3 / 2)
    assert [(g["before"], g["after"]) for g in r["gaps"]] == [("e", "d"), ("d", "b")]
    assert [g["ms"] for g in r["gaps"]] == pytest.approx([0.069, 0.010])
    assert prof_mod.idle_gaps([], steps=1)["gaps"] == []
    assert prof_mod.idle_gaps(ivs, steps=1, k=1)["gaps"] == [{"ms": pytest.approx(0.069), "before": "e",
                                                              "after": "d"}]


def test_host_extra_ranks_the_operators_that_grew_over_plain(prof_mod):
    # µs and calls over two steps: conv grew by 3 ms and 4 calls, launch by 1 ms and 20 calls, relu shrank,
    # the elasticlab operator is new
    method = {"conv": (5000.0, 8), "launch": (3000.0, 60), "relu": (100.0, 2),
              "elasticlab::conv_norms": (800.0, 4)}
    plain = {"conv": (2000.0, 4), "launch": (2000.0, 40), "relu": (300.0, 2), "only_plain": (50.0, 2)}
    r = prof_mod.host_extra(method, plain, steps=2, k=3)
    assert r["ms_per_step"] == pytest.approx((3000 + 1000 - 200 + 800 - 50) / 1e3 / 2)
    assert [(t["name"], t["ms"], t["calls"]) for t in r["top"]] == [
        ("conv", pytest.approx(1.5), 2), ("launch", pytest.approx(0.5), 10),
        ("elasticlab::conv_norms", pytest.approx(0.4), 2)]


def test_device_ops_keep_the_kernels_and_rank_like_the_host_ones(prof_mod):
    """device_ops takes the CUDA kernels of a profile's averages (the host operators stay with host_ops);
    host_extra ranks them the same way."""
    class Evt:
        def __init__(self, key, kind, dev, cpu, count):
            self.key, self.device_type, self.count = key, f"DeviceType.{kind}", count
            self.self_device_time_total, self.self_cpu_time_total = dev, cpu

    # a profile's averaged events (prof.key_averages())
    psgn = [Evt("gemm", "CUDA", 900.0, 0.0, 6), Evt("_outer_norms_tma_kernel", "CUDA", 500.0, 0.0, 2),
            Evt("aten::mm", "CPU", 40.0, 30.0, 6)]
    plain = [Evt("gemm", "CUDA", 1000.0, 0.0, 8), Evt("aten::mm", "CPU", 50.0, 35.0, 8)]
    dev = prof_mod.device_ops(psgn)
    assert dev == {"gemm": (900.0, 6), "_outer_norms_tma_kernel": (500.0, 2)}
    assert prof_mod.host_ops(psgn) == {"aten::mm": (30.0, 6)}
    top = prof_mod.top_events(psgn, torch.device("cuda"), k=1, steps=2)     # the kernels alone, ranked
    assert top["total_ms_per_step"] == pytest.approx(0.7) and [t["name"] for t in top["top"]] == ["gemm"]
    r = prof_mod.host_extra(dev, prof_mod.device_ops(plain), steps=2, k=2)
    assert r["ms_per_step"] == pytest.approx(0.2)
    assert [(t["name"], t["calls"]) for t in r["top"]] == [("_outer_norms_tma_kernel", 1), ("gemm", -1)]


def test_cpu_smoke_run_prints_the_tables(prof_mod, capsys):
    assert prof_mod.main(["--device", "cpu", "--quick", "--precision", "fp32", "--steps", "1",
                          "--warmup", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1][len("RESULT "):])
    fp32 = res["precisions"]["fp32"]
    assert "error" not in fp32["psgn"] and fp32["psgn"]["total_ms_per_step"] > 0
    assert "idle" not in fp32["psgn"]              # a CPU run has no device timeline
    assert fp32["psgn"]["kernels_per_step"] == 0 and fp32["psgn"]["aten_ops_per_step"] > 0
    assert fp32["plain"]["aten_ops_per_step"] > 0
    extra = fp32["psgn_host_extra"]                # where psgn's host time went, against plain
    assert len(extra["top"]) == 3 and "wall_ms_per_step" in extra   # (timings: noisy, so no ranking asserted)
    assert all(isinstance(t["calls"], float) for t in extra["top"]), extra["top"]
    assert "host_ops" not in fp32["psgn"], "host_ops belongs out of the RESULT line"
    assert "device_ops" not in fp32["psgn"] and "psgn_device_extra" not in fp32    # no kernels on a CPU run
    assert "the operators that grew most" in out
