"""benchmarks/gpu_check.sh, the one prepared GPU script, run on the CPU through a stand-in python that turns
``cuda`` into ``cpu`` and shrinks the runs: its bench and profile stages (the second profile included) must
run, write their logs and summary, and exit 0. A GPU session has minutes, not reruns: a broken stage should
fail here first."""
from __future__ import annotations

import os
import subprocess
import sys

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
