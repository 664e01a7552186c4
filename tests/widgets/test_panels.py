"""Control panels without a browser: their logic, their widgets' state, and their errors."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from elasticlab.widgets._common import LiveFigure, Poller, html_table, subplots_figure, write_json_atomic


class FakeJob:
    """An ElasticJob stand-in: records requests, produces metrics/events on demand."""

    def __init__(self, workers=2):
        self.slots, self.options, self.policy, self.entry_kwargs = 4, {"lr_rule": "constant"}, None, {}
        self._state, self._ws, self._m, self._e = "new", workers, [], []
        self.resizes = []
        self.t0 = time.time()

    def start(self):
        self._state = "running"
        self._e.append({"kind": "start", "time": self.t0, "t": 0.0})
        self._e.append({"kind": "generation", "time": self.t0 + 0.1, "t": 0.1, "world_size": self._ws})

    def step(self, n=1):
        for _ in range(n):
            k = len(self._m)
            self._m.append({"step": k + 1, "epoch": 0, "time": self.t0 + 0.2 + 0.01 * k,
                            "loss": 2.0 / (k + 1),
                            "samples_per_s": 100.0 * self._ws, "world_size": self._ws, "global_batch": 64,
                            "lr": 0.1, "gns": None if k < 2 else 50.0 + k})

    def resize(self, n):
        self.resizes.append(n)
        self._ws = n
        self._e.append({"kind": "generation", "time": time.time(), "t": 1.0, "world_size": n})
        self._e.append({"kind": "resize", "time": time.time(), "t": 1.0, "from_size": 2, "to_size": n})
        return ("future", n)

    def pause(self):
        self._state = "paused"

    def resume(self, n=None):
        self._state = "running"

    def stop(self):
        self._state = "stopped"

    def status(self):
        return {"state": self._state, "world_size": self._ws if self._state == "running" else 0,
                "target_world_size": self._ws, "step": len(self._m), "epoch": 0, "global_batch": 64,
                "per_worker_batch": 64 // self._ws, "accum_steps": 0, "generation": 1, "workers": {},
                "lost_steps": 0, "error": None}

    def metrics(self, since=0):
        return [dict(r) for r in self._m[since:]]

    def events(self, since=0):
        return [dict(e) for e in self._e[since:]]


def _arr(v) -> np.ndarray:
    """A trace's array from plotly JSON: a list, or a typed array ``{"dtype", "bdata"}`` (base64)."""
    if isinstance(v, dict) and "bdata" in v:
        import base64

        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
    return np.asarray(v)


def _plotly_spec(live: LiveFigure) -> dict:
    """The figure as the front end gets it: the Output's plotly mime bundle, or the FigureWidget's state
    (its edits reach the browser as messages; the browser side: tests/notebooks/test_in_browser.py)."""
    if live.backend == "output":
        (out,) = live.widget.outputs
        return out["data"]["application/vnd.plotly.v1+json"]
    return json.loads(live.figure.to_json())


def test_job_panel_draws_metrics_and_resizes():
    from elasticlab.widgets import JobPanel

    job = FakeJob()
    panel = JobPanel(job, autostart_poll=False, chart_every_s=0.0, status_file=None)
    assert panel.workers.value == 2 and panel.start_button.disabled is False
    panel.start()
    job.step(5)
    panel.refresh()
    assert "data-state='running'" in panel.status_label.value
    spec = _plotly_spec(panel.chart)
    ws = next(t for t in spec["data"] if t["name"] == "world_size")
    assert ws["y"] == [2] * 5
    loss = next(t for t in spec["data"] if t["name"] == "loss")
    assert loss["y"][0] == pytest.approx(2.0)
    # GNS is None for the first steps: drawn as gaps (NaN -> null), not as zeros
    gns = next(t for t in spec["data"] if t["name"] == "gns")
    assert gns["y"][0] is None and gns["y"][-1] == pytest.approx(54.0)
    # moving the slider resizes the job; the chart then shows the new world size and a marker line
    panel.workers.value = 3
    assert job.resizes == [3]
    job.step(3)
    panel.refresh()
    spec = _plotly_spec(panel.chart)
    ws = next(t for t in spec["data"] if t["name"] == "world_size")
    assert ws["y"][-1] == 3 and 2 in ws["y"]
    titles = [a["text"] for a in spec["layout"]["annotations"]]
    assert "World size (now 3)" in titles
    assert len(spec["layout"]["shapes"]) == 2 * 6  # two generations, marked on all six charts
    assert "resize" in panel.log.value
    panel.stop()
    assert job.status()["state"] == "stopped" and panel.stop_button.disabled and panel.workers.disabled


def test_job_panel_lr_rule_and_policy_choices():
    from elasticlab.elastic.policies import FixedPerWorkerBatch
    from elasticlab.widgets import JobPanel

    job = FakeJob()
    panel = JobPanel(job, autostart_poll=False)
    panel.lr_rule.value = "sqrt"
    assert job.options["lr_rule"] == "sqrt"
    panel.policy.value = "fixed_per_worker"
    assert isinstance(job.policy, FixedPerWorkerBatch) and job.policy.per_worker_batch == 32
    assert job.options["lr_rule"] == "dynamic_sgd"  # the policy's own rule, before the start
    panel.start()
    panel.refresh()
    assert panel.lr_rule.disabled
    panel.lr_rule.value = "linear"  # ignored once running: the workers carry the rule
    assert job.options["lr_rule"] == "dynamic_sgd"


def test_job_panel_policy_now_resume_and_warm_note():
    """Issue 20 item 5: a policy change says what it changes (the batch at each size); a resume from pause is
    logged as one (its own event kind, "resumed", since issue 15); growing past the warm processes says why it
    is slow; the axes start at 0 with whole-number ticks for the batch and the world size."""
    from elasticlab.widgets import JobPanel

    job = FakeJob()
    job.status_workers = {0: {"state": "active"}, 1: {"state": "active"}, 2: {"state": "idle"}}
    status = job.status
    job.status = lambda: {**status(), "workers": job.status_workers}
    panel = JobPanel(job, autostart_poll=False, chart_every_s=0.0)
    panel.start()
    job.step(3)
    panel.refresh()
    panel.policy.value = "fixed_per_worker"   # 32 per worker, sized from 64 at 2 workers
    assert ("global batch 64 now; from the next resize, by workers 1: 32, 2: 64, 3: 96, 4: 128"
            in panel.log.value)
    job._ws = 2
    panel.workers.value = 3                   # 3 warm processes: no note
    assert "must start" not in panel.log.value
    panel.workers.value = 4
    assert "1 more worker process beyond the 3 warm ones must start" in panel.log.value
    job._e.append({"kind": "resumed", "time": time.time(), "world_size": 4, "step": 9, "latency_s": 0.5})
    panel.refresh()
    assert "<b>resumed</b> world_size=4, step=9, latency_s=0.5" in panel.log.value
    job._e.append({"kind": "resume", "time": time.time(), "generation": 3, "step": 9, "world_size": 4})
    panel.refresh()
    assert "<b>restored</b> generation=3, step=9, world_size=4" in panel.log.value
    spec = _plotly_spec(panel.chart)
    lay = spec["layout"]
    assert lay["yaxis5"]["range"] == pytest.approx([0, 0.1 * 1.15]) and lay["yaxis5"]["tickformat"] == ".3~g"
    assert lay["yaxis4"]["range"] == [0, 74] and lay["yaxis4"]["tickformat"] == "d"
    assert lay["yaxis6"]["dtick"] == 1


def test_job_panel_reads_event_kinds_states_and_defaults_from_the_job_registries():
    """Issue 15: the events the panel logs or marks are kinds of the job's list (records.EVENT_KINDS), its
    buttons follow the job's states (JobState), and a job without a batch policy shows FixedGlobalBatch's
    registered name and LR rule."""
    from elasticlab.elastic.policies import FixedGlobalBatch, batch_policy_name
    from elasticlab.elastic.records import EVENT_KINDS
    from elasticlab.elastic.states import TERMINAL, JobState
    from elasticlab.widgets import JobPanel
    from elasticlab.widgets.job_panel import LOGGED, MARKED

    assert set(LOGGED) <= set(EVENT_KINDS) and set(MARKED) <= set(EVENT_KINDS) and "resumed" in LOGGED
    job = FakeJob()
    job.options = {}
    panel = JobPanel(job, autostart_poll=False)
    assert panel.policy.value == batch_policy_name(FixedGlobalBatch) == "fixed_global"
    assert panel.lr_rule.value == FixedGlobalBatch.lr_rule == "constant"
    for state in JobState:
        job._state = state.value
        panel.refresh()
        assert panel.start_button.disabled == (state != JobState.NEW), state
        assert panel.pause_button.disabled == (state in TERMINAL or state == JobState.NEW), state
        assert panel.pause_button.description == ("resume" if state == JobState.PAUSED else "pause"), state
        assert panel.stop_button.disabled == (state in TERMINAL), state


def test_job_panel_writes_status_file_and_downsamples(tmp_path):
    from elasticlab.widgets import JobPanel

    job = FakeJob()
    path = tmp_path / "status.json"
    panel = JobPanel(job, autostart_poll=False, status_file=path, chart_every_s=0.0, max_points=50)
    panel.start()
    job.step(1000)
    panel.refresh()
    st = json.loads(path.read_text())
    assert st["state"] == "running" and st["panel_steps"] == 1000
    spec = _plotly_spec(panel.chart)
    loss = next(t for t in spec["data"] if t["name"] == "loss")
    assert 40 <= len(loss["y"]) <= 52 and loss["y"][-1] == pytest.approx(2.0 / 1000)


def test_job_panel_rejects_bad_input():
    from elasticlab.widgets import JobPanel

    with pytest.raises(TypeError, match="has no start"):
        JobPanel(object())
    with pytest.raises(ValueError, match="poll_s"):
        JobPanel(FakeJob(), poll_s=0)
    with pytest.raises(ValueError, match="max_points must be a whole number >= 10, got 3"):
        JobPanel(FakeJob(), max_points=3)                # was raised to 10 without a word
    with pytest.raises(ValueError, match="chart_every_s must be a finite number of seconds >= 0, got 'x'"):
        JobPanel(FakeJob(), chart_every_s="x")
    panel = JobPanel(FakeJob(), autostart_poll=False)
    with pytest.raises(ValueError, match="workers must be"):
        panel.resize(99)


def test_poller_keeps_running_after_errors():
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return len(calls) < 4 or False

    errors = []
    p = Poller(fn, 0.01, on_error=errors.append).start()
    deadline = time.time() + 10
    while p.running and time.time() < deadline:
        time.sleep(0.01)
    assert len(calls) == 4 and "boom" in p.error and len(errors) == 1
    with pytest.raises(ValueError, match="interval_s"):
        Poller(fn, 0)


def test_common_helpers(tmp_path):
    path = tmp_path / "a" / "s.json"
    write_json_atomic(path, {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1} and list(path.parent.iterdir()) == [path]
    assert "<td" in html_table([{"a": 1.23456, "b": "<x>"}]) and "&lt;x&gt;" in html_table([{"b": "<x>"}])


@pytest.mark.parametrize("backend", ["figurewidget", "output"])
def test_live_figure_backends(backend, monkeypatch):
    import plotly.graph_objects as go

    monkeypatch.setenv("ELASTICLAB_CHARTS", backend)
    live = LiveFigure(subplots_figure(["one", "two"], rows=1, cols=2))
    assert live.backend == backend
    assert isinstance(live.figure, go.FigureWidget) == (backend == "figurewidget")
    live.figure.add_scatter(x=[1, 2], y=[3, 4], row=1, col=2)
    live.show()
    assert _plotly_spec(live)["data"][0]["y"] == [3, 4]
    monkeypatch.setenv("ELASTICLAB_CHARTS", "svg")
    with pytest.raises(ValueError, match="svg"):
        LiveFigure(subplots_figure(["a"], rows=1, cols=1))


@pytest.mark.parametrize("backend", ["figurewidget", "output"])
def test_live_figure_updates_from_threads(backend):
    live = LiveFigure(subplots_figure(["a"], rows=1, cols=1), backend=backend)
    live.figure.add_scatter(x=[], y=[])

    def work(i):
        for k in range(20):
            live.figure.data[0].y = list(range(k))
            live.show()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_plotly_spec(live)["data"][0]["y"]) == 19


def test_fitness_utility_orders_like_the_power_mean():
    from elasticlab.goodput import fitness
    from elasticlab.widgets.allocation import fitness_utility

    rng = np.random.default_rng(0)
    for p in (-2.0, -1.0, 0.0, 0.5, 1.0):
        a, b = rng.uniform(0.5, 4, size=(2, 5))
        ua, ub = fitness_utility(a, p).sum(), fitness_utility(b, p).sum()
        assert (ua > ub) == (fitness(a, p) > fitness(b, p))
    assert fitness_utility(np.array([0.0, 1.0]), -1.0)[0] == -np.inf
    assert fitness_utility(np.array([0.0, 1.0]), 1.0)[0] == 0.0


def test_allocation_dp_beats_baselines_on_fitness():
    from elasticlab.widgets.allocation import allocate, job_table

    table = job_table(("cifar10", "imagenet", "bert"))
    res = allocate(table, capacity=8, p=-1.0, baselines=("gpu-elastic", "optimus"))
    dp = res["allocations"]["dp"]
    assert sum(dp.values()) <= 8 and min(dp.values()) >= 1
    for m, tot in res["totals"].items():
        assert tot["gpus"] <= 8
        assert res["totals"]["dp"]["fitness"] >= tot["fitness"] - 1e-9, m
    # p = 1: the DP maximises the plain sum of speedups (Pollux Eq. (8)), which the chart shows
    res1 = allocate(table, capacity=8, p=1.0, baselines=("gpu-elastic", "optimus"))
    names, speed = res1["jobs"], res1["speedup"]
    for m, tot in res1["totals"].items():
        g = [res1["allocations"][m][n] for n in names]
        assert tot["speedup"] == pytest.approx(sum(speed[j, gj] for j, gj in enumerate(g)))
        assert res1["totals"]["dp"]["speedup"] >= tot["speedup"] - 1e-9, m
    with pytest.raises(ValueError, match="every job needs a GPU"):
        allocate(table, capacity=2, p=-1.0)
    with pytest.raises(ValueError, match="capacity"):
        allocate(table, capacity=0, p=1.0)


def test_allocation_defaults_come_from_the_registries():
    """Issue 15: the explorer's baselines are the allocation policies marked ``baseline`` (the four it listed
    itself before) and its default jobs are the artifact's applications; none is listed in the widget."""
    from elasticlab.alloc.policies import POLICIES
    from elasticlab.sim.traces import APPLICATIONS
    from elasticlab.widgets import allocation

    assert allocation.baseline_policies() == tuple(n for n, cls in POLICIES.items() if cls.baseline)
    assert set(allocation.BASELINES) == {"gpu-elastic", "optimus", "tiresias", "fifo"}
    assert allocation.DEFAULT_JOBS == tuple(APPLICATIONS) and len(APPLICATIONS) == 6
    assert list(allocation.job_table().application) == list(APPLICATIONS)


def test_allocation_explorer_sliders_recompute():
    from elasticlab.widgets import AllocationExplorer

    ex = AllocationExplorer(jobs=("cifar10", "imagenet", "bert"), capacity=12, max_capacity=16,
                            baselines=("gpu-elastic",))
    before = dict(ex.result["allocations"]["dp"])
    assert sum(before.values()) == 12
    ex.capacity.value = 4
    after = ex.result["allocations"]["dp"]
    assert sum(after.values()) <= 4 and after != before
    assert "dp" in ex.totals.value
    spec = _plotly_spec(ex.chart)
    assert list(_arr(spec["data"][0]["y"])) == [after[n] for n in ex.result["jobs"]]
    with pytest.raises(ValueError, match="capacity"):
        AllocationExplorer(jobs=("cifar10", "imagenet"), capacity=1)
    with pytest.raises(ValueError, match="capacity must be a whole number >= 1, got '8'"):
        AllocationExplorer(capacity="8")
    with pytest.raises(ValueError, match=r"p must be a fairness power in \[-3, 1\].*got nan"):
        AllocationExplorer(p=float("nan"))                       # was "utility contains NaN" from the DP
    with pytest.raises(ValueError, match=r"unknown baseline policies \['nope'\]; choose from"):
        AllocationExplorer(baselines=["nope"])                   # was a message in the panel only


def test_simulation_dashboard_runs_policies():
    from elasticlab.widgets import SimulationDashboard

    d = SimulationDashboard("workload-6", policies=("tiresias", "fifo"), cluster="2x4", limit=6)
    d.run()
    s = d.summary()
    assert list(s.index) == ["tiresias", "fifo"] and (s.completed == 6).all()
    assert d.progress.value == 2 and "tiresias" in d.table.value
    spec = _plotly_spec(d.chart)
    cdf = spec["data"][0]
    assert len(_arr(cdf["x"])) == 6 and _arr(cdf["y"])[-1] == pytest.approx(1.0)
    # a failed run leaves no chart or table of the previous one up (issue 20, notebook 03)
    d.cluster.value = "0x4"
    with pytest.raises(ValueError):
        d.run()
    assert "simulation failed" in d.message.value
    assert not _plotly_spec(d.chart)["data"] and "tiresias" not in d.table.value
    with pytest.raises(ValueError, match="unknown policies"):
        SimulationDashboard(policies=("nope",))
    with pytest.raises(ValueError, match="cluster"):
        SimulationDashboard(cluster="big")


class FakeCluster:
    """A LocalCluster stand-in for the ClusterPanel: one job whose goodput exists only while it runs."""

    slots, policy_name = 4, "goodput"

    def __init__(self):
        self.rows = [{"name": "a", "state": "running", "slots": 2, "goodput": 123.4, "jct": None}]

    def submit(self, spec):
        return "x"

    def jobs(self):
        return [dict(r) for r in self.rows]

    def metrics(self):
        return {"avg_jct": None, "slots_used": 2, "slots": 4, "policy": "goodput", "queued": 0, "running": 1,
                "paused": 0, "finished": 0, "failed": 0, "dropped": 0, "restart_cost_s": 0.0}

    def history(self):
        return [{"t": 0.0, "slots": {"a": 2}, "batch": {"a": 32}}]

    def events(self, since=0):
        return []

    def set_policy(self, name):
        self.policy_name = name

    def now(self):
        return 1.0


def test_cluster_panel_keeps_last_goodput_and_readable_colour_bar():
    """Issue 20 item 6: the goodput column was None for every job once they finished; the colour bar
    ticks once per slot count (its labels overlapped)."""
    from elasticlab.widgets import ClusterPanel

    cl = FakeCluster()
    panel = ClusterPanel(cl, autostart_poll=False)
    assert "123.4" in panel.table.value and "goodput (M0-samples/s)" in panel.table.value
    cl.rows[0].update(state="finished", goodput=None, jct=12.5)
    panel.refresh()
    assert "123.4 (last)" in panel.table.value and "None" not in panel.table.value
    bar = panel.figure.data[0].colorbar
    assert list(bar.tickvals) == [0, 1, 2, 3, 4] and panel.figure.layout.height >= 220
    panel.close()


def test_log_axis_labels_ticks_in_full():
    from elasticlab.plotting import log_axis

    ax = log_axis([12.0, 45.0, 80.0, -3.0, float("nan"), None])
    assert ax["type"] == "log" and ax["tickvals"] == [10, 20, 50, 100]
    assert ax["ticktext"] == ["10", "20", "50", "100"]      # plotly's own read "2", "5" for 20, 50
    wide = log_axis([0.003, 5e4])
    assert wide["tickvals"][0] == pytest.approx(1e-3) and wide["ticktext"][-1] == "100,000"
    assert log_axis([0.0, -1.0]) == {"type": "log"}


def test_plotting_rejects_bad_input(tmp_path):
    import plotly.graph_objects as go

    from elasticlab.plotting import save_figure

    with pytest.raises(ValueError, match="unsupported image format 'bmp'"):
        save_figure(go.Figure(), tmp_path / "x.bmp")
    with pytest.raises(ValueError, match="width"):
        save_figure(go.Figure(), tmp_path / "x.png", width=0)
    with pytest.raises(TypeError, match="plotly figure"):
        save_figure(object(), tmp_path / "x.png")


@pytest.mark.browser
def test_plotting_exports_png_and_svg(tmp_path):
    import plotly.graph_objects as go

    from elasticlab.plotting import save_figures

    figs = {"a": go.Figure(go.Scatter(y=[1, 3, 2])), "b": go.Figure(go.Bar(y=[2, 1]))}
    out = save_figures(figs, tmp_path, format="png", width=300, height=200)
    assert out["a"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = save_figures({"c": figs["b"]}, tmp_path, format="svg")["c"].read_text()
    assert svg.lstrip().startswith("<svg")


def test_write_json_atomic_from_many_threads(tmp_path):
    """Panels write their status file from the kernel thread and from their poller at the same time: every
    write lands whole and none fails (a shared temporary name made one os.replace miss its file)."""
    path = tmp_path / "status.json"
    errors = []

    def work(i):
        try:
            for k in range(50):
                write_json_atomic(path, {"thread": i, "k": k})
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert json.loads(path.read_text())["k"] == 49
    assert list(tmp_path.iterdir()) == [path]
