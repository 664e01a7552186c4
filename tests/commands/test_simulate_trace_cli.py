"""``elasticlab simulate --trace`` (issue 19): a window of the Philly trace from the command line, the result
line with wall time and peak memory, and the trace flags checked before anything runs."""
import json
import subprocess
import sys

import pytest


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", "elasticlab", "simulate", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_trace_window_runs_and_reports(tmp_path):
    p = _run(["--trace", "philly", "--trace-start", "1000", "--trace-hours", "0.25", "--cluster", "4x4",
              "--policy", "tiresias", "--no-progress"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "on trace philly" in p.stdout and "peak memory" in p.stdout
    r = json.loads(p.stdout.strip().splitlines()[-1][len("RESULT "):])
    assert r["jobs"] >= 2 and r["completed"] == r["jobs"]
    assert r["wall_s"] > 0 and r["peak_rss_mb"] > 10 and r["avg_queue_delay"] >= 0


@pytest.mark.parametrize("extra, expect", [
    (["--trace-hours", "0"], "--trace-hours must be a finite number of hours > 0, got 0.0"),
    (["--trace-start", "-1"], "--trace-start must be a finite number of hours >= 0, got -1.0"),
    (["--load", "nan"], "--load must be a finite load factor > 0, got nan"),
    (["--seed", "-3"], "--seed must be a whole number >= 0, got -3"),
])
def test_bad_trace_flags_are_named(tmp_path, extra, expect):
    p = _run(["--trace", "philly", "--policy", "fifo", "--no-progress", *extra], tmp_path)
    assert p.returncode == 2 and expect in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "RESULT" not in p.stdout


def test_trace_and_workload_are_exclusive(tmp_path):
    p = _run(["--trace", "philly", "--workload", "workload-6", "--policy", "fifo"], tmp_path)
    assert p.returncode == 2 and "not allowed with" in p.stderr
    q = _run(["--trace", str(tmp_path / "none.csv"), "--policy", "fifo", "--no-progress"], tmp_path)
    assert q.returncode == 2 and "not found" in q.stderr


@pytest.mark.parametrize("extra, named", [
    (["--load", "2"], "--load applies"),
    (["--trace-hours", "5", "--seed", "1"], "--trace-hours, --seed apply"),
])
def test_trace_flags_with_a_workload_are_an_error_not_ignored(tmp_path, extra, named):
    p = _run(["--workload", "workload-6", "--policy", "fifo", "--no-progress", *extra], tmp_path)
    assert p.returncode == 2 and named in p.stderr and "only with --trace" in p.stderr, p.stderr
    assert "RESULT" not in p.stdout


def test_flag_check_has_no_side_effect_and_names_real_keywords():
    """The check leaves flags not given as None (trace_workload's own defaults apply, listed once there), and
    each trace flag maps to a keyword trace_workload takes."""
    import argparse
    import inspect

    from elasticlab.commands import simulate as cmd
    from elasticlab.sim.trace_workload import trace_workload

    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    args = parser.parse_args(["--trace", "philly", "--policy", "fifo", "--load", "2"])
    before = dict(vars(args))
    assert cmd._check_flags(args) is None
    assert vars(args) == before and args.trace_start is None and args.seed is None
    params = inspect.signature(trace_workload).parameters
    assert {kw for _, kw in cmd.TRACE_ONLY.values()} <= set(params)
    args.load = 0.0
    assert cmd._check_flags(args) == "--load must be a finite load factor > 0, got 0.0"
