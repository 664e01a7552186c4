"""Trace-replay simulator: traces, the job model, workloads, the engine, results, the CLI."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from elasticlab.alloc.policies import Cluster
from elasticlab.sim import SimJob, load_application, load_workload, simulate
from elasticlab.sim.traces import canonical_placement


def test_canonical_placement_rotations():
    assert canonical_placement((0, 2, 1, 0, 1)) == (1, 1, 2)
    assert canonical_placement((3, 1, 2, 1)) == (1, 2, 1, 3)
    assert canonical_placement(()) == ()
    # any numbers in: ints out, zeros (0, 0.0, np.int64(0)) dropped, on a 640-node cluster's placement too
    wide = [0] * 640
    wide[5], wide[600], wide[601] = np.int64(2), 4.0, 1
    got = canonical_placement(wide)
    assert got == (1, 2, 4) and all(type(x) is int for x in got)


def test_grad_stats_kept_per_batch_and_epoch_are_the_interpolation():
    app = load_application("cifar10")
    rng = np.random.default_rng(3)
    batches = [128, 128.0, 4096, 9000.5, 50, np.float64(300.5)] + list(range(128, 600, 37))
    for batch in batches + [float(x) for x in rng.uniform(100, 5000, 40)]:
        for epoch in (0, 7, 99, 150, -3):
            e = min(max(epoch, 0), app.max_epochs - 1)
            want = (float(np.interp(batch, app.batch_sizes, app._sqr[:, e])),
                    float(np.interp(batch, app.batch_sizes, app._var[:, e])))
            assert app.grad_stats(batch, epoch) == want and app.grad_stats(batch, epoch) == want
    assert app.grad_stats(np.array(192.0), 3) == app.grad_stats(192.0, 3)  # a 0-d array: computed, not kept


def test_step_time_measured_and_interpolated():
    app = load_application("cifar10")
    row = app.placements[(app.placements.placement == "22")].iloc[0]
    step, sync = app.step_time((0, 2, 0, 2), row.local_bsz)
    assert step == pytest.approx(row.step_time) and sync == pytest.approx(row.sync_time)
    # a 5-node placement is not measured: interpolated, finite and slower than on one node
    s5, _ = app.step_time((4, 4, 4, 4, 4), 64)
    s1, _ = app.step_time((4,), 64)
    assert np.isfinite(s5) and s5 > s1
    with pytest.raises(ValueError):
        app.step_time((), 64)


def test_grad_stats_and_progress():
    app = load_application("cifar10")
    assert app.init_batch_size == 128 and app.max_batch_size == 4096 and app.max_epochs == 100
    sqr, var = app.grad_stats(128, 0)
    df = app.validation[128]
    assert sqr == pytest.approx(df.grad_sqr[0]) and var == pytest.approx(df.grad_var[0])
    mid = app.grad_stats(192, 3)[0]
    lo, hi = app.grad_stats(128, 3)[0], app.grad_stats(256, 3)[0]
    assert min(lo, hi) <= mid <= max(lo, hi)
    b = [app.progress_at(e) for e in range(app.max_epochs + 1)]
    assert b[0] == 0 and np.all(np.diff(b) > 0) and b[-1] == app.max_progress


def test_job_progress_restart_delay_and_completion():
    app = load_application("bert")
    job = SimJob("bert-x", app, 0.0, 2, 24, "fixed")
    job.step(60)
    assert job.progress == 0 and job.current_time == 60  # no GPUs: only time passes
    job.reallocate((2,))
    assert job.gpus == 2 and job.batch_size >= 24
    job.step(30)  # the restart delay: GPU time charged, no progress
    assert job.progress == 0 and job.attained_service == pytest.approx(60)
    job.step(60)
    assert job.progress > 0
    p = job.progress
    while not job.done:
        job.step(600)
        assert job.progress >= p
        p = job.progress
    assert job.epoch == app.max_epochs and job.completion_time <= job.current_time
    assert job.remaining_iterations() == 0


def test_goodput_batch_grows_with_gpus():
    app = load_application("cifar10")
    job = SimJob("c", app, 0.0, 1, 128, "goodput")
    job.reallocate((1,))
    job.step(600)  # now profiled
    job.epoch = 60  # late in training: large noise scale
    job.grad_params = app.grad_stats(1024, 60)
    job.reallocate((4, 4))
    assert job.batch_size > 128 * 2
    curve = job.speedup_curve(16, 4)
    assert curve[0] == 0 and curve[1] == pytest.approx(1.0) and curve[8] > 2


def test_load_workload_and_errors(tmp_path):
    df = load_workload("workload-6")
    assert len(df) == 160 and set(df.application) <= {"bert", "cifar10", "deepspeech2", "imagenet", "ncf",
                                                      "yolov3"}
    assert len(load_workload("6", limit=10)) == 10
    with pytest.raises(ValueError, match="not found"):
        load_workload("workload-99")
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"name": ["a"], "time": [0], "application": ["gpt5"], "num_replicas": [1],
                  "batch_size": [8]}).to_csv(bad, index=False)
    with pytest.raises(ValueError, match="gpt5"):
        load_workload(bad)
    with pytest.raises(ValueError, match="NODESxGPUS"):
        Cluster.parse("16-4")


@pytest.fixture(scope="module")
def small_runs():
    return {p: simulate("workload-6", p, limit=24, progress=False)
            for p in ("fifo", "tiresias", "optimus", "pollux", "goodput", "gpu-elastic", "saxena")}


def test_small_runs_complete_and_respect_capacity(small_runs):
    for pol, res in small_runs.items():
        s = res.summary
        assert s["completed"] == 24, pol
        assert 0 < s["avg_jct"] <= s["p99_jct"] + 1e-9
        assert (res.utilisation.gpus_used <= 64).all()
        assert res.jobs.jct.min() > 30  # at least the start-up delay
        assert np.all(res.jcts == res.jobs.jct.dropna().to_numpy())


def test_adaptive_policies_beat_fifo_on_small_run(small_runs):
    fifo = small_runs["fifo"].summary["avg_jct"]
    assert small_runs["pollux"].summary["avg_jct"] < fifo
    assert small_runs["goodput"].summary["avg_jct"] < fifo


def test_result_json_roundtrip(small_runs, tmp_path):
    res = small_runs["tiresias"]
    path = tmp_path / "r.json"
    res.to_json(path)
    d = json.loads(path.read_text())
    assert d["summary"]["avg_jct"] == pytest.approx(res.summary["avg_jct"])
    assert len(d["jobs"]) == 24 and "utilisation" in d["utilisation"]


def test_simulate_deterministic():
    a = simulate("workload-6", "optimus", limit=8, progress=False).summary
    b = simulate("workload-6", "optimus", limit=8, progress=False).summary
    assert a["avg_jct"] == b["avg_jct"]


def test_cli_result_line(tmp_path):
    out = tmp_path / "o.json"
    cmd = [sys.executable, "-m", "elasticlab", "simulate"]
    args = ["--workload", "workload-6", "--policy", "tiresias", "--limit", "6", "--no-progress",
            "--out", str(out)]
    p = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    r = json.loads(last[len("RESULT "):])
    assert {"avg_jct", "p99_jct", "makespan"} <= set(r) and r["avg_jct"] > 0
    assert out.exists()
    bad = subprocess.run(cmd + ["--workload", "nope.csv", "--policy", "fifo"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "not found" in bad.stdout + bad.stderr


def test_artifact_numbers_and_fidelity_on_subset():
    from elasticlab.sim.experiments import artifact_avg_jct, fidelity

    assert artifact_avg_jct("tiresias") == pytest.approx(3469.69, abs=0.01)
    assert artifact_avg_jct("optimus") == pytest.approx(5301.9, abs=0.1)
    with pytest.raises(ValueError, match="no results"):
        artifact_avg_jct("fifo")
    df = fidelity("workload-6", ("tiresias",), limit=5)
    assert len(df) == 1 and "artifact_avg_jct" not in df
    row = df.iloc[0]
    assert row.completed == 5 and row.avg_jct == pytest.approx(np.mean(row.jcts), rel=1e-12)
    # the five jobs' tuned GPU counts fit the 64 GPUs together, so under tiresias none waits or is
    # preempted: each JCT is the one it has alone on the cluster, and above the 30 s start-up
    wl = load_workload("workload-6", limit=5)
    assert wl.num_replicas.sum() <= 64
    alone = [simulate(wl.iloc[[i]], "tiresias", progress=False).jcts[0] for i in range(5)]
    assert np.min(alone) > 30
    assert row.jcts == pytest.approx(alone, rel=1e-9)


@pytest.mark.slow
@pytest.mark.repro
def test_fidelity_workload6_full():
    """Issue 10: Tiresias-/Optimus-like within 10% of the artifact on workload-6, Pollux within 15%."""
    from elasticlab.sim.experiments import fidelity

    df = fidelity("workload-6", ("tiresias", "optimus", "pollux"))
    assert df.within_tolerance.all(), df[["policy", "avg_jct", "artifact_avg_jct", "rel_error"]]


def test_throughput_fit_cache_keys_on_the_fitting_code(tmp_path, monkeypatch):
    """The on-disk fit is keyed by the traces *and* the fitting code's source: a hit equals a fresh fit, and
    a change to the fitting code misses the old entry (issue 21: a stale cache hid changes to the fit)."""
    from elasticlab.sim import traces

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fresh = traces.Application("ncf").throughput_model                 # miss: fits and writes
    files = list((tmp_path / "elasticlab").glob("throughput-ncf-*.json"))
    assert len(files) == 1
    hit = traces.Application("ncf").throughput_model                   # hit: read back
    assert hit.as_dict() == fresh.as_dict()
    monkeypatch.setattr(traces, "fit_code_version", lambda: "another version of the fitting code")
    refit = traces.Application("ncf").throughput_model                 # a miss: fitted again
    assert len(list((tmp_path / "elasticlab").glob("throughput-ncf-*.json"))) == 2
    assert refit.as_dict() == fresh.as_dict()
