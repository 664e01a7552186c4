"""The simulator's inputs (issue 20 items 4 and 7): where its data comes from, and bad workloads / flags give
a clear error naming the bad value at once instead of a hang, a traceback or a silent wrong run."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import elasticlab
from elasticlab.alloc.dp import dp_allocate, dp_allocate_reference
from elasticlab.sim import load_workload, simulate
from elasticlab.sim.traces import APPLICATIONS, DATA_ENV, PACKAGED_DATA, data_dir
from elasticlab.sim.workload import workload_names

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- item 7: the data ships with the package
def test_default_data_is_the_packaged_copy(monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    d = data_dir()
    assert d == PACKAGED_DATA
    assert Path(elasticlab.__file__).resolve().parent in d.parents  # inside the package, not ../shared
    for app in APPLICATIONS:
        assert (d / "traces" / app / "placements.csv").is_file()
        assert (d / "traces" / app / "scalability.csv").is_file()
        assert list((d / "traces" / app).glob("validation-*.csv"))
    for i in range(1, 7):
        assert (d / "workloads" / f"workload-{i}.csv").is_file()
        assert (d / "workloads-realistic" / f"workload-{i}.csv").is_file()
    for pol in ("pollux", "optimus", "tiresias"):  # what sim.experiments.artifact_avg_jct reads
        assert (d / "paper-results" / "results-jobload" / f"{pol}-1.0" / "summary.json").is_file()
    # an empty variable is the same as none
    monkeypatch.setenv(DATA_ENV, "")
    assert data_dir() == PACKAGED_DATA
    assert len(load_workload("workload-6")) == 160


def test_data_lookup_has_no_build_machine_path():
    src = (ROOT / "elasticlab" / "sim" / "traces.py").read_text()
    assert "/work/" not in src and '"shared"' not in src


def test_env_override_pointing_nowhere_says_what_to_do(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(DATA_ENV, str(missing))
    with pytest.raises(ValueError, match=DATA_ENV) as e:
        data_dir()
    assert str(missing) in str(e.value) and "unset" in str(e.value)


def test_env_override_is_used(monkeypatch, tmp_path):
    (tmp_path / "workloads").mkdir()
    (tmp_path / "workloads" / "mine.csv").write_text(
        "name,time,application,num_replicas,batch_size\nj0,0,cifar10,1,128\n")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert data_dir() == tmp_path
    assert load_workload("mine").name.tolist() == ["j0"]


def test_unknown_workload_lists_the_valid_names():
    names = workload_names()
    assert names[:6] == [f"workload-{i}" for i in range(1, 7)] and "realistic/workload-6" in names
    with pytest.raises(ValueError, match="workload-99") as e:
        load_workload("workload-99")
    assert "workload-1, workload-2" in str(e.value) and "realistic/workload-6" in str(e.value)


def test_cli_runs_without_shared_data_beside_the_repo(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != DATA_ENV}
    out = subprocess.run([sys.executable, "-m", "elasticlab", "simulate", "--workload", "workload-6",
                          "--policy", "fifo", "--limit", "2", "--no-progress"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert '"completed": 2' in out.stdout
    bad = subprocess.run([sys.executable, "-m", "elasticlab", "simulate", "--workload", "workload-99",
                          "--policy", "fifo", "--no-progress"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "workload-6" in bad.stdout + bad.stderr


# ---------------------------------------------------------------- item 4: bad input fails at once, clearly
_HEADER = "name,time,application,num_replicas,batch_size\n"
_GOOD = "a,0,cifar10,1,128\n"


def _quick(fn, *args, **kwargs):
    """The ValueError ``fn`` raises, checking that it came within a second."""
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        fn(*args, **kwargs)
    assert time.perf_counter() - t0 < 1.0, f"took {time.perf_counter() - t0:.2f} s"
    return str(e.value)


@pytest.fixture(scope="module", autouse=True)
def _warm():
    simulate("workload-6", "fifo", limit=1, progress=False)  # imports and trace loading out of the timing


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows, expect", [
    ("", "has no jobs"),                                  # header only
    ("b,,cifar10,1,128\n", "job 'b', line 3 has time an empty value"),
    ("b,inf,cifar10,1,128\n", "job 'b', line 3 has time inf"),
    ("b,soon,cifar10,1,128\n", "job 'b', line 3 has time 'soon'"),
    ("b,-5,cifar10,1,128\n", "job 'b', line 3 has time -5"),
    ("b,1e12,cifar10,1,128\n", "time 1e+12 s"),           # finite, but 1.7e10 rounds away
    ("b,10,cifar10,0,128\n", "num_replicas 0"),
    ("b,10,cifar10,1.5,128\n", "num_replicas 1.5"),
    ("b,10,cifar10,1,\n", "batch_size an empty value"),
    (",10,cifar10,1,128\n", "line 3 has no name"),
    ("b,10,gpt5,1,128\n", "unknown application 'gpt5'"),
])
def test_bad_workload_rows(tmp_path, rows, expect):
    path = tmp_path / "w.csv"
    path.write_text(_HEADER + (_GOOD if rows else "") + rows)
    msg = _quick(simulate, path, "fifo", progress=False)
    assert expect in msg, msg
    assert str(path) in msg or "1e+12" in msg, msg  # names the file (or the late job and its time)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs, expect", [
    ({"interval": float("nan")}, "interval must be a finite number of seconds > 0, got nan"),
    ({"interval": float("inf")}, "interval must be a finite number of seconds > 0, got inf"),
    ({"interval": 0}, "interval must be"),
    ({"restart_delay": float("nan")}, "restart_delay must be a finite number of seconds >= 0, got nan"),
    ({"restart_delay": -1}, "restart_delay must be"),
    ({"limit": 0}, "limit must be a whole number of jobs >= 1, got 0"),
    ({"limit": -158}, "got -158"),
    ({"limit": 2.5}, "got 2.5"),
    ({"max_time": float("nan")}, "max_time must be"),
])
def test_bad_simulate_arguments(kwargs, expect):
    msg = _quick(simulate, "workload-6", "fifo", progress=False, **kwargs)
    assert expect in msg, msg


def test_bad_dataframe_workload():
    df = load_workload("workload-6", limit=3)
    df["time"] = df.time.astype(float)
    df.loc[1, "time"] = float("inf")
    msg = _quick(simulate, df, "fifo", progress=False)
    assert "has time inf" in msg and repr(df.name[1]) in msg
    assert "has no jobs" in _quick(simulate, df.head(0), "fifo", progress=False)


def test_late_job_runs_with_max_time(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text(_HEADER + _GOOD + "b,1e12,cifar10,1,128\n")
    res = simulate(path, "fifo", max_time=3600, progress=False)  # a horizon makes it finite: allowed
    assert res.summary["jobs"] == 2 and res.summary["completed"] <= 1


@pytest.mark.timeout(120)
def test_cli_rejects_bad_flags_before_running(tmp_path):
    (tmp_path / "header.csv").write_text(_HEADER)
    cases = [
        (["--limit", "-158"], "--limit must be a whole number of jobs >= 1, got -158"),
        (["--limit", "0"], "got 0"),
        (["--interval", "nan"], "--interval must be a finite number of seconds > 0, got nan"),
        (["--restart-delay", "nan"], "--restart-delay must be a finite number of seconds >= 0, got nan"),
        (["--out", str(tmp_path / "missing" / "r.json")], f"{str(tmp_path / 'missing')!r} does not exist"),
        (["--workload", "header.csv"], "has no jobs"),
    ]
    for extra, expect in cases:
        args = ["--workload", "workload-6", "--policy", "fifo", "--no-progress", *extra]
        p = subprocess.run([sys.executable, "-m", "elasticlab", "simulate", *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (extra, p.stdout, p.stderr)
        assert expect in p.stderr and "Traceback" not in p.stderr, (extra, p.stderr)
        assert "RESULT" not in p.stdout
    assert not (tmp_path / "missing").exists()


def test_dp_capacity_far_beyond_the_table_is_fast():
    u = np.log1p(np.arange(6.0))[None, :].repeat(3, axis=0)
    u[1, 2] = 5.0  # a non-concave row: through the DP, whose table is (rows, capacity + 1)
    # every path's compiled code loaded outside the timing
    assert dp_allocate(u, 15).tolist() == dp_allocate(u, 15, method="dp").tolist() == [5, 2, 5]
    assert dp_allocate_reference(u, 15).tolist() == [5, 2, 5]
    assert dp_allocate(np.zeros((3, 5)), 15).tolist() == [0, 0, 0]
    t0 = time.perf_counter()
    assert dp_allocate(np.zeros((3, 5)), 300_000_000).tolist() == [0, 0, 0]  # was 18 s and 8.4 GB
    assert dp_allocate(u, 10**12).tolist() == dp_allocate(u, 15, method="dp").tolist() == [5, 2, 5]
    assert dp_allocate_reference(u, 10**12).tolist() == [5, 2, 5]
    assert time.perf_counter() - t0 < 1.0


def test_dp_bounds_of_any_size_or_a_clear_error():
    u = np.log1p(np.arange(9.0))[None, :].repeat(3, axis=0)
    free = dp_allocate(u, 8).tolist()
    for big in (1e30, 10**30, [10**30, 10**30, 10**30]):  # larger than any count: no bound
        assert dp_allocate(u, 8, max_gpus=big).tolist() == free
    for bad, expect in (("abc", "max_gpus must be whole numbers >= 0"), (float("inf"), "got inf for job 0"),
                        ([1, None, 2], "got nan for job 1"), (1.5, "got 1.5")):
        with pytest.raises(ValueError, match=expect):
            dp_allocate(u, 8, max_gpus=bad)
    with pytest.raises(ValueError, match="needs at least 1e\\+30 GPUs"):
        dp_allocate(u, 8, min_gpus=1e30)
