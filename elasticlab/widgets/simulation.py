"""SimulationDashboard: replay a Pollux-artifact workload, or a window of a whole cluster trace (Philly),
under several scheduling policies and compare them.

Each policy runs through :func:`elasticlab.sim.simulate` (on a background thread when started from the
button, so the kernel stays free) with a progress bar; the dashboard draws the job-completion-time CDFs,
the GPU utilisation over time and the queueing delay (the views of :mod:`elasticlab.sim.plots`), and a
table of the summaries (average / median / p99 JCT, makespan, utilisation, queueing delay, restarts).
"""
from __future__ import annotations

import html
import threading

import ipywidgets as W
import numpy as np

from elasticlab.widgets._common import LiveFigure, Panel, color, html_table, subplots_figure

SUMMARY_COLUMNS = ["policy", "jobs", "completed", "avg_jct", "median_jct", "p99_jct", "makespan",
                   "gpu_utilisation", "avg_queue_delay", "restarts"]
#: The dropdown's entry for a trace window (``trace=`` of the dashboard).
TRACE_PREFIX = "trace: "


def available_workloads() -> list[str]:
    """Names of the artifact's workloads found in the shared data folder."""
    from elasticlab.sim.workload import workload_path

    names = []
    for i in range(1, 9):
        try:
            workload_path(f"workload-{i}")
        except ValueError:
            continue
        names.append(f"workload-{i}")
    return names


def compare_policies(workload="workload-6", policies=None, cluster="16x4", limit=None,
                     interval: float = 60.0, on_result=None) -> dict:
    """Run ``workload`` (a shared name, CSV or DataFrame, e.g. from :func:`elasticlab.sim.trace_workload`)
    under each policy (default: :data:`elasticlab.sim.experiments.ARTIFACT_POLICIES`); returns {policy:
    SimResult}. ``on_result(policy, result)`` is called after each one (the dashboard's progress)."""
    from elasticlab.alloc.policies import POLICIES
    from elasticlab.sim import simulate
    from elasticlab.sim.experiments import ARTIFACT_POLICIES

    policies = ARTIFACT_POLICIES if policies is None else policies

    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ValueError(f"unknown or no policies {bad or list(policies)}; choose from {sorted(POLICIES)}")
    out = {}
    for pol in policies:
        out[pol] = simulate(workload, pol, cluster, interval=interval, limit=limit, progress=False)
        if on_result is not None:
            on_result(pol, out[pol])
    return out


def jct_cdf(result) -> tuple[np.ndarray, np.ndarray]:
    """Sorted job completion times (hours) and their empirical CDF (:func:`elasticlab.sim.plots.jct_cdf`)."""
    from elasticlab.sim.plots import jct_cdf as cdf

    return cdf(result)


class SimulationDashboard(Panel):
    """Pick a workload, a cluster and policies, press run; compare JCT CDFs, utilisation, queueing delay and
    summaries. ``trace=("philly", start_h, hours)`` adds that trace window
    (:func:`elasticlab.sim.trace_workload`, seed 0) to the workloads, selected at start."""

    def __init__(self, workload: str = "workload-6", policies=None, cluster: str = "16x4",
                 limit: int | None = None, trace: tuple | None = None):
        from elasticlab.alloc.policies import POLICIES, Cluster
        from elasticlab.sim.experiments import ARTIFACT_POLICIES

        policies = ARTIFACT_POLICIES if policies is None else policies

        Cluster.parse(cluster)  # a clear error for a malformed cluster
        names = available_workloads() or [workload]
        self._trace = None
        if trace is not None:
            from elasticlab.sim.trace_workload import trace_workload

            src, start, hours = trace
            self._trace = trace_workload(src, start=start, hours=hours)  # bad values: a clear error now
            workload = f"{TRACE_PREFIX}{src} [{start:g} h, +{hours:g} h]"
            names = [workload, *names]
        if workload not in names:
            raise ValueError(f"workload {workload!r} not found; available: {names}")
        bad = [p for p in policies if p not in POLICIES]
        if bad:
            raise ValueError(f"unknown policies {bad}; choose from {sorted(POLICIES)}")
        if limit is not None and int(limit) < 1:
            raise ValueError(f"limit must be >= 1 job, got {limit!r}")
        self.workload = W.Dropdown(options=names, value=workload, description="workload")
        self.cluster = W.Text(value=cluster, description="cluster", layout=W.Layout(width="200px"))
        self.limit = W.IntText(value=int(limit or 0), description="jobs (0=all)",
                               layout=W.Layout(width="200px"))
        self.policies = W.SelectMultiple(options=sorted(POLICIES), value=tuple(policies), rows=4,
                                         description="policies")
        self.run_button = W.Button(description="run", icon="play", button_style="primary")
        self.progress = W.IntProgress(value=0, min=0, max=1, description="0 / 0")
        self.progress.add_class("elasticlab-sim-progress")
        self.table = W.HTML()
        self.table.add_class("elasticlab-sim-table")
        self.message = W.HTML()
        fig = subplots_figure(["Job completion time CDF", "GPU utilisation", "Queueing delay CDF"], rows=1,
                              cols=3, height=380)
        fig.update_xaxes(title_text="JCT (hours)", row=1, col=1)
        fig.update_yaxes(title_text="fraction of jobs", range=[0, 1.02], row=1, col=1)
        fig.update_xaxes(title_text="time (hours)", row=1, col=2)
        fig.update_yaxes(title_text="GPUs busy", range=[0, 1.02], row=1, col=2)
        fig.update_xaxes(title_text="submission to first GPUs (hours)", row=1, col=3)
        fig.update_yaxes(title_text="fraction of jobs", range=[0, 1.02], row=1, col=3)
        fig.update_layout(showlegend=True, legend={"orientation": "h", "y": -0.2})
        self.chart = LiveFigure(fig)
        self.figure = self.chart.figure
        self.results: dict = {}
        self._thread: threading.Thread | None = None
        self.run_button.on_click(lambda _: self.run(block=False))
        self.widget = W.VBox([W.HTML("<b>elasticlab · simulation dashboard</b>"),
                              W.HBox([W.VBox([self.workload, self.cluster, self.limit]), self.policies]),
                              W.HBox([self.run_button, self.progress]), self.chart.widget, self.table,
                              self.message])
        self.widget.add_class("elasticlab-simulation-dashboard")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, block: bool = True) -> dict:
        """Simulate the chosen policies (on a thread unless ``block``); returns the results so far."""
        if self.running:
            return self.results
        if block:
            self._run()
        else:
            self._thread = threading.Thread(target=self._run, name="elasticlab-sim", daemon=True)
            self._thread.start()
        return self.results

    def wait(self, timeout: float | None = None) -> dict:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.results

    def _run(self) -> None:
        pols = list(self.policies.value)
        self.results = {}
        self.progress.max, self.progress.value = max(1, len(pols)), 0
        self.progress.description = f"0 / {len(pols)}"
        self.run_button.disabled = True
        self.message.value = ""
        try:
            wl = self.workload.value
            if wl.startswith(TRACE_PREFIX) and self._trace is not None:
                wl = self._trace
            compare_policies(wl, pols, self.cluster.value.strip(),
                             limit=self.limit.value or None, on_result=self._on_result)
        except Exception as e:
            self.draw()         # the charts and table of this run (none, or those done), not the last's
            self.message.value = f"<span style='color:#c00'>simulation failed: {html.escape(str(e))}</span>"
            if threading.current_thread() is threading.main_thread():
                raise
        finally:
            self.run_button.disabled = False

    def _on_result(self, policy: str, result) -> None:
        self.results[policy] = result
        self.progress.value = len(self.results)
        self.progress.description = f"{len(self.results)} / {self.progress.max}"
        self.draw()

    def draw(self) -> None:
        """Redraw the charts and the table from :attr:`results` (the traces of :mod:`elasticlab.sim.plots`'s
        figures, in one row of subplots)."""
        from elasticlab.sim.plots import jct_cdf_figure, queueing_figure, utilisation_figure

        fig = self.figure
        views = [f(self.results) for f in (lambda r: jct_cdf_figure(r, log_x=False), utilisation_figure,
                                           queueing_figure)]
        with fig.batch_update():
            fig.data = ()
            for col, view in enumerate(views, start=1):
                for i, tr in enumerate(view.data):
                    fig.add_scatter(x=tr.x, y=tr.y, mode="lines", name=tr.name, showlegend=col == 1,
                                    line={"color": color(i), "shape": tr.line.shape, "width": tr.line.width},
                                    row=1, col=col)
        self.chart.show()
        rows = [{"policy": p, **{k: r.summary.get(k, "") for k in SUMMARY_COLUMNS[1:]}}
                for p, r in self.results.items()]
        self.table.value = html_table(rows, SUMMARY_COLUMNS)

    def summary(self):
        """The comparison table as a pandas DataFrame (one row per policy)."""
        import pandas as pd

        return pd.DataFrame([{"policy": p, **r.summary} for p, r in self.results.items()]).set_index("policy")

