"""benchmarks/gpu_check.sh, the one prepared GPU script, run on the CPU through a stand-in python that turns
``cuda`` into ``cpu`` and shrinks the runs: its bench and profile stages (the second profile included) must
run, write their logs and summary, and exit 0. A GPU session has minutes, not reruns: a broken stage should
fail here first."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

STAND_IN = """#!/usr/bin/env bash
# python for gpu_check.sh on a CPU: cuda -> cpu; the benchmark and the profiles made small
out=()
for a in "$@"; do if [ "$a" = "cuda" ]; then out+=("cpu"); else out+=("$a"); fi; done
case " ${out[*]} " in
  *bench_psgnorm.py*) out+=(--quick --workloads W1 --methods plain,psgn --iters 2 --warmup 1 --no-memory
                            --threads 2);;
  *profile_psgnorm.py*) out+=(--quick --steps 1 --warmup 1 --top 3 --threads 2);;
esac
exec PYTHON "${out[@]}"
"""


def test_bench_and_profile_stages_run_through(tmp_path):
    py = tmp_path / "python"
    py.write_text(STAND_IN.replace("PYTHON", sys.executable))
    py.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(py), STAGES="bench profile", DEADLINE_S="400",
               PROFILE_ARGS="--precision fp32", PROFILE2_ARGS="--workload W1 --precision fp32")
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert "== bench_psgnorm --device cuda: ok" in summary, summary
    assert "== profile_psgnorm --device cuda: ok" in summary, summary
    assert "== profile_psgnorm --workload W1 --precision fp32: ok" in summary, summary
    assert "W1-fp32: plain" in summary                         # the bench table reached the summary
    assert "psgn/plain CPU op time" in summary and "ATen ops" in summary
    profile = (out / "profile.log").read_text()
    assert "G1-fp32 psgn" in profile and "==== SECOND PROFILE (--workload W1 --precision fp32)" in profile
    assert "W1-fp32 psgn" in profile.split("==== SECOND PROFILE")[1]
    assert sorted(p.name for p in out.iterdir()) == ["bench_cuda.log", "profile.log", "summary.txt"]


TESTS_THEN_BENCH = """#!/usr/bin/env bash
# python for gpu_check.sh: its GPU tests print FAILURES and fail; the bench reports the switches it was given
case " $* " in
  *" -m pytest "*) printf '%s\\n' FAILURES "2 failed, 80 passed"; exit 1;;
  *bench_psgnorm.py*) echo "switches TMA=${ELASTICLAB_TRITON_TMA:-unset}" \\
                        "GHOST=${ELASTICLAB_TRITON_GHOST:-unset}"
                      echo "RuntimeWarning: triton_tune: forms left out: {'tma-flat': 'disagrees with" \\
                        "pointer-nested: result 1: max |difference| 0.5'}" >&2; exit 0;;
esac
exec PYTHON "$@"
"""


def _run_test_and_bench(tmp_path, failures: list[str]) -> str:
    """summary.txt of gpu_check.sh's test and bench stages with these FAILED lines from the tests."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    py = tmp_path / "python"
    lines = " ".join(f"'FAILED {f}'" for f in failures)
    py.write_text(TESTS_THEN_BENCH.replace("PYTHON", sys.executable).replace("FAILURES", lines))
    py.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(py), STAGES="test bench", DEADLINE_S="200")
    for k in ("ELASTICLAB_TRITON_TMA", "ELASTICLAB_TRITON_GHOST"):
        env.pop(k, None)
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return (out / "summary.txt").read_text()


def test_a_failed_tma_or_gram_kernel_test_keeps_those_forms_out_of_the_later_stages(tmp_path):
    """A kernel that faults on the GPU would end the bench's process (a CUDA error poisons the context):
    after a failed TMA test the later stages run with ELASTICLAB_TRITON_TMA=0, after a failed Gram-kernel
    test with ELASTICLAB_TRITON_GHOST=0, and the summary says so. A failure elsewhere (the cuBLAS Gram
    operator's test, say) sets neither."""
    summary = _run_test_and_bench(tmp_path / "a", [
        "tests/gns/test_triton_outer.py::test_tma_loads[bf16] - RuntimeError: x",
        "tests/gns/test_triton_gram.py::test_ghost_norms_match_float64 - AssertionError"])
    assert "a TMA test failed" in summary and "a Gram-kernel test failed" in summary, summary
    assert "switches TMA=0 GHOST=0" in summary, summary
    summary = _run_test_and_bench(tmp_path / "b", ["tests/gns/test_kernels.py::test_cuda_gram_norms - Error"])
    assert "test failed" not in summary and "switches TMA=unset GHOST=unset" in summary, summary


def test_a_form_left_out_for_a_wrong_result_is_named_in_the_summary(tmp_path):
    """The bench's stderr warning that the tuner left a form out because its result departed from the
    first form's (elasticlab.gns.timing) reaches summary.txt under WRONG RESULTS."""
    summary = _run_test_and_bench(tmp_path, [])
    assert "== WRONG RESULTS" in summary, summary
    assert "1 disagrees with pointer-nested: result 1: max |difference| 0.5" in summary, summary


ECHO = """#!/usr/bin/env bash
# python for gpu_check.sh: prints what it was asked to run
echo "ran: $*"
"""


@pytest.mark.parametrize("conv", ["1", "0"])
def test_the_ops_and_test_stages_take_their_arguments(tmp_path, conv):
    """OPS_ARGS go to bench_seq_linear_cuda.py (a sweep on chosen layers), CONV_ARGS to bench_conv_cuda.py,
    which OPS_CONV=0 leaves out; TEST_PATHS replaces tests/ as what pytest -m gpu collects."""
    py = tmp_path / "python"
    py.write_text(ECHO)
    py.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(py), STAGES="test ops", DEADLINE_S="100", OPS_CONV=conv,
               OPS_ARGS="--sweep-only G3.up,G3.down", CONV_ARGS="--iters 3",
               TEST_PATHS="tests/gns/test_triton_tune.py tests/gns/test_triton_outer.py")
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ops = (out / "ops.log").read_text()
    assert "ran: benchmarks/bench_seq_linear_cuda.py --sweep-only G3.up,G3.down" in ops
    assert ("ran: benchmarks/bench_conv_cuda.py --iters 3" in ops) == (conv == "1"), ops
    tests = (out / "pytest_gpu.log").read_text()
    assert tests.strip().endswith("tests/gns/test_triton_tune.py tests/gns/test_triton_outer.py"), tests
    assert " tests/ " not in tests + " "
