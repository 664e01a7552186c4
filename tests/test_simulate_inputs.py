"""The simulator's inputs (issue 20 items 4 and 7): where its data comes from, and bad workloads / flags give
a clear error naming the bad value at once instead of a hang, a traceback or a silent wrong run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import elasticlab
from elasticlab.sim import load_workload
from elasticlab.sim.traces import APPLICATIONS, DATA_ENV, PACKAGED_DATA, data_dir
from elasticlab.sim.workload import workload_names

ROOT = Path(__file__).resolve().parent.parent


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
