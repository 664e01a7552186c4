"""Whole-trace workloads (issue 19): Philly or a generic trace CSV -> a simulator workload by the artifact's
rules, deterministic by seed, any window and load, and clear errors naming bad values."""
import numpy as np
import pandas as pd
import pytest

from elasticlab.sim import simulate
from elasticlab.sim.trace_workload import configurations, read_trace, trace_workload
from elasticlab.sim.workload import check_workload


def test_configurations_are_the_artifacts():
    """The artifact's get_configurations(0.5, 0.8): exactly the (replicas, batch) pairs its shared workloads
    hold, e.g. cifar10 at 6/8 GPUs with 2048 and 12/16 with 4096, ncf 1 x 32768."""
    conf = {a: {c[:2] for c in configurations(a)} for a in ("cifar10", "ncf", "yolov3", "imagenet")}
    assert conf["cifar10"] == {(6, 2048), (8, 2048), (12, 4096), (16, 4096)}
    assert conf["ncf"] == {(1, 32768)}
    assert conf["yolov3"] == {(4, 64)}
    assert conf["imagenet"] == {(24, 3200), (32, 6400), (48, 6400)}


def test_philly_window_is_deterministic_and_follows_the_rules():
    a = trace_workload("philly", start=1000, hours=24, seed=3)
    b = trace_workload("philly", start=1000, hours=24, seed=3)
    c = trace_workload("philly", start=1000, hours=24, seed=4)
    pd.testing.assert_frame_equal(a, b)
    assert not a.equals(c)
    check_workload(a)  # a valid workload
    assert a.time.min() >= 0 and a.time.max() < 24 * 3600 and a.time.is_monotonic_increasing
    assert a.name.is_unique and len(a) > 300
    tr = read_trace("philly")
    win = tr[(tr.time >= 1000 * 3600) & (tr.time < 1024 * 3600) & (tr.duration >= 60)
             & (tr.gpu_time < 1000 * 3600)]
    assert len(a) == len(win)
    # the GPU-time categories: short jobs are cifar10/ncf, the longest imagenet
    assert (a.application.isin(["cifar10", "ncf"])).sum() == (win.gpu_time < 3600).sum()
    assert (a.application == "imagenet").sum() == (win.gpu_time >= 100 * 3600).sum()
    # load factor: half / double the jobs of the same window
    assert len(trace_workload("philly", start=1000, hours=24, load=0.5, seed=3)) == round(0.5 * len(a))
    assert len(trace_workload("philly", start=1000, hours=24, load=2.0, seed=3)) == 2 * len(a)


def test_generic_trace_csv_and_a_short_run(tmp_path):
    p = tmp_path / "t.csv"
    rows = ["timestamp,duration,num_gpus", "0,120,1", "600,4000,2", "30,59,1", "1200,20000,8", "90,7200,1"]
    p.write_text("\n".join(rows) + "\n")
    w = trace_workload(p, seed=0)
    assert len(w) == 4  # the 59-s job is left out
    assert list(w.time) == [0, 90, 600, 1200]
    assert w.application.iloc[0] in ("cifar10", "ncf") and w.application.iloc[3] == "yolov3"
    res = simulate(w.iloc[:2], "goodput", cluster="4x4", progress=False)
    assert res.summary["completed"] == 2
    # date-time timestamps work too, counted from the first job
    q = tmp_path / "d.csv"
    q.write_text("timestamp,duration,num_gpus\n2017-10-01 00:00:10,100,1\n2017-10-01 00:01:10,100,1\n")
    assert list(trace_workload(q).time) == [0, 60]


@pytest.mark.parametrize("line, match", [
    ("5,abc,1", "duration 'abc'"),
    ("5,100,0", "num_gpus 0"),
    ("5,100,1.5", "num_gpus 1.5"),
    ("yesterday,100,1", "timestamp 'yesterday'"),
    ("5,-3,1", "duration -3"),
])
def test_bad_trace_rows_are_named(tmp_path, line, match):
    p = tmp_path / "bad.csv"
    p.write_text(f"timestamp,duration,num_gpus\n0,100,1\n{line}\n")
    with pytest.raises(ValueError, match=match) as e:
        trace_workload(p)
    assert "line 3" in str(e.value)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        trace_workload(tmp_path / "none.csv")
    p = tmp_path / "cols.csv"
    p.write_text("time,dur\n1,2\n")
    with pytest.raises(ValueError, match="lacks columns"):
        trace_workload(p)
    for kw, match in (({"load": 0}, "load"), ({"load": float("nan")}, "load"), ({"hours": -1}, "hours"),
                      ({"start": -2}, "start"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed")):
        with pytest.raises(ValueError, match=match):
            trace_workload("philly", **kw)
    with pytest.raises(ValueError, match="no job"):
        trace_workload("philly", start=1e6, hours=1)


def test_whole_trace_size():
    """The whole trace: 82k rows, of which the artifact's filter keeps ~74k jobs over ~109 days."""
    tr = read_trace("philly")
    assert len(tr) > 82_000
    w = trace_workload("philly")
    assert 70_000 < len(w) < len(tr) and w.time.max() > 100 * 86400
    assert np.all(np.diff(w.time.to_numpy()) >= 0)


def test_plots_and_dashboard_on_a_trace_window():
    """The result views (issue 19) on a small Philly window: JCT CDF, utilisation, queueing delay, table;
    the dashboard runs the same window."""
    from elasticlab.sim import plots
    from elasticlab.widgets import SimulationDashboard

    w = trace_workload("philly", start=1000, hours=0.5, seed=0)
    assert 5 <= len(w) <= 60
    res = {p: simulate(w, p, cluster="4x4", progress=False) for p in ("tiresias", "fifo")}
    for fig in (plots.jct_cdf_figure(res), plots.utilisation_figure(res, max_points=20),
                plots.queueing_figure(res)):
        assert [t.name for t in fig.data] == ["tiresias", "fifo"]
        assert all(len(t.x) == len(t.y) > 0 for t in fig.data)
    assert len(plots.utilisation_figure(res, max_points=20).data[0].x) <= 20
    cdf = plots.jct_cdf_figure(res).data[0]
    assert np.all(np.diff(cdf.x) >= 0) and cdf.y[-1] == pytest.approx(1.0)
    table = plots.results_table(res)
    assert list(table.index) == ["tiresias", "fifo"] and (table.completed == len(w)).all()
    assert (table.avg_queue_delay >= 0).all() and (table.p99_jct >= table.avg_jct * 0.5).all()
    d = SimulationDashboard(policies=("fifo",), cluster="4x4", trace=("philly", 1000, 0.5))
    assert d.workload.value.startswith("trace: philly")
    d.run()
    assert d.summary().completed.iloc[0] == len(w)
    with pytest.raises(ValueError, match="hours"):
        SimulationDashboard(trace=("philly", 1000, -1))
