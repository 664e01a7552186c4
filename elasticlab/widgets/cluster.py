"""ClusterPanel: a :class:`~elasticlab.cluster.LocalCluster` in a notebook.

Jobs are rows of a chart of their slots over time (a heatmap: one row per job, colour = slots held), with
a status table (state, slots, batch, step, GNS, predicted goodput, JCT so far), the cluster's metrics, a
submit form (example job kind or any ``module:function`` entrypoint, slot and batch ranges, epochs) and
the policy choice. Everything updates from :meth:`ClusterPanel.refresh`, which a background poller calls;
it works headless (no frontend needed), so tests drive the panel directly.
"""
from __future__ import annotations

import html

import ipywidgets as W

from elasticlab.widgets._common import LiveFigure, PolledPanel, html_table

_COLUMNS = ["name", "state", "slots", "global_batch", "accum_steps", "step", "epoch", "gns",
            "goodput (M0-samples/s)", "jct (s)", "restarts"]
_LOGGED = ("submit", "refused", "drop", "start", "resize", "set_batch", "pause", "resume", "finished",
           "failed", "stop", "error")


def _example_entrypoints() -> dict:
    try:
        from elasticlab.cluster.experiments import examples_path

        ex = examples_path()
    except FileNotFoundError:
        return {}
    return {k: f"{ex}:{k}" for k in ("compute_bound", "comm_bound", "gns_growing", "crashing")}


class ClusterPanel(PolledPanel):
    """Control panel of a :class:`~elasticlab.cluster.LocalCluster` (display it as a cell's last line).

    ``poll_s``: refresh period of the background poller (``autostart_poll=False`` for none).
    """

    def __init__(self, cluster, *, poll_s: float = 0.5, autostart_poll: bool = True):
        for name in ("submit", "jobs", "metrics", "history", "events", "set_policy"):
            if not callable(getattr(cluster, name, None)):
                raise TypeError(f"ClusterPanel needs a LocalCluster-like object; "
                                f"{type(cluster).__name__} has no {name}()")
        if poll_s <= 0:
            raise ValueError(f"poll_s must be positive, got {poll_s!r}")
        from elasticlab.cluster.policies import policy_names

        self.cluster = cluster
        self._n_events = 0
        self._log: list[str] = []
        self._n_history = -1
        self._goodput: dict[str, float] = {}   # the last predicted goodput seen per job (running only)

        # ---- policy and submit form ------------------------------------------------------------
        self.policy = W.Dropdown(options=policy_names(), value=cluster.policy_name, description="policy",
                                 layout=W.Layout(width="230px"))
        self.policy.observe(self._on_policy, names="value")
        self.examples = _example_entrypoints()
        self.kind = W.Dropdown(options=[*self.examples, "custom"],
                               value=next(iter(self.examples), "custom"), description="job",
                               layout=W.Layout(width="230px"))
        self.entrypoint = W.Text(value="", placeholder="module:function (custom)", description="entrypoint",
                                 layout=W.Layout(width="360px"))
        self.name = W.Text(value="", placeholder="(auto)", description="name", layout=W.Layout(width="230px"))
        self.slot_range = W.IntRangeSlider(value=(1, cluster.slots), min=1, max=max(cluster.slots, 1),
                                           description="slots", layout=W.Layout(width="300px"))
        self.initial_batch = W.BoundedIntText(value=32, min=1, max=1 << 20, description="batch M0",
                                              layout=W.Layout(width="180px"))
        self.max_batch = W.BoundedIntText(value=256, min=1, max=1 << 20, description="max batch",
                                          layout=W.Layout(width="180px"))
        self.epochs = W.BoundedIntText(value=2, min=1, max=10_000, description="epochs",
                                       layout=W.Layout(width="160px"))
        self.submit_button = W.Button(description="submit", icon="plus", button_style="primary",
                                      layout=W.Layout(width="100px"))
        self.submit_button.on_click(lambda _: self.submit())
        self.message = W.HTML(value="")

        # ---- views -----------------------------------------------------------------------------
        import plotly.graph_objects as go

        fig = go.Figure()
        fig.update_layout(title={"text": "slots per job over time", "x": 0.02, "font": {"size": 13}},
                          height=self._height(0), margin={"l": 80, "r": 15, "t": 35, "b": 40},
                          xaxis_title="time since the cluster started (s)", template="plotly_white")
        # one tick per slot count, at most 5 labels, the title beside the bar: on a short chart the labels
        # of a tick every 0.5 slot were drawn over each other
        step = max(1, -(-cluster.slots // 4))
        fig.add_heatmap(x=[], y=[], z=[], colorscale="Blues", zmin=0, zmax=cluster.slots, xgap=0, ygap=2,
                        colorbar={"title": {"text": "slots", "side": "right"}, "len": 1.0, "thickness": 14,
                                  "tickmode": "array", "tickvals": list(range(0, cluster.slots + 1, step))},
                        hovertemplate="%{y} at %{x:.1f}s: %{z} slots<extra></extra>")
        self.table = W.HTML(value="")
        self.metrics_label = W.HTML(value="")
        self.log = W.HTML(value="", layout=W.Layout(max_height="150px", overflow="hidden auto",
                                                    border="1px solid #ddd", padding="2px 6px"))
        form = W.VBox([W.HBox([self.kind, self.entrypoint, self.name]),
                       W.HBox([self.slot_range, self.initial_batch, self.max_batch, self.epochs,
                               self.submit_button]), self.message])
        self.chart = LiveFigure(fig)
        self.figure = self.chart.figure
        chart = self.chart.widget
        self.widget = W.VBox([W.HTML("<b>elasticlab · local cluster</b>"), W.HBox([self.policy]),
                              self.metrics_label, chart, self.table,
                              W.HTML("<b>submit a job</b>"), form, W.HTML("<b>events</b>"), self.log])
        self.widget.add_class("elasticlab-cluster-panel")
        self._start_polling(poll_s, "elasticlab-clusterpanel", self._append, autostart_poll)

    # ---- actions -----------------------------------------------------------------------------------
    def submit(self) -> str | None:
        """Submit the form's job; a bad value shows its error in the panel (and returns None)."""
        from elasticlab.cluster import JobSpec

        entry = self.examples.get(self.kind.value) if self.kind.value != "custom" else self.entrypoint.value
        lo, hi = self.slot_range.value
        try:
            if not entry:
                raise ValueError("give an entrypoint ('module:function') for a custom job")
            spec = JobSpec(entry, name=self.name.value.strip() or None, min_slots=lo, max_slots=hi,
                           initial_batch=int(self.initial_batch.value),
                           max_batch=max(int(self.max_batch.value), int(self.initial_batch.value)),
                           epochs=int(self.epochs.value), warm=lo, record_samples=True)
            name = self.cluster.submit(spec)
        except (ValueError, TypeError) as e:
            self.message.value = f"<span style='color:#c00'>refused: {html.escape(str(e))}</span>"
            return None
        self.message.value = f"submitted <b>{html.escape(name)}</b>"
        self.refresh()
        return name

    def _on_policy(self, change) -> None:
        self.cluster.set_policy(change["new"])
        self._append(f"policy → <b>{html.escape(change['new'])}</b>")

    def _append(self, line: str) -> None:
        self._log.append(line)
        self._log = self._log[-200:]
        self.log.value = "<br>".join(reversed(self._log))

    # ---- refresh -----------------------------------------------------------------------------------
    @staticmethod
    def _height(jobs: int) -> int:
        return max(220, 80 + 32 * jobs)

    def _row(self, r: dict) -> dict:
        """A job's table row: the predicted goodput exists only while it runs, so a job that stopped
        running shows the last one seen, marked (last); "–" where none was ever predicted."""
        g = r.get("goodput")
        if g is not None:
            self._goodput[r["name"]] = g
            shown = g
        elif r["name"] in self._goodput:
            shown = f"{self._goodput[r['name']]:.4g} (last)"
        else:
            shown = None
        return {**r, "goodput (M0-samples/s)": shown, "jct (s)": r.get("jct")}

    def slots_matrix(self) -> tuple[list[float], list[str], list[list[int]]]:
        """(times, job names, slots[job][time]) from the cluster's history: the heatmap's data."""
        hist = self.cluster.history()
        names = [r["name"] for r in self.cluster.jobs()]
        times = [h["t"] for h in hist]
        z = [[int(h["slots"].get(n, 0)) for h in hist] for n in names]
        return times, names, z

    def refresh(self) -> None:
        """Pull the cluster's state into the chart, the table, the metrics line and the event log."""
        cl = self.cluster
        rows = cl.jobs()
        self.table.value = html_table([self._row(r) for r in rows], _COLUMNS)
        m = cl.metrics()
        avg = "–" if m["avg_jct"] is None else f"{m['avg_jct']:.1f}s"
        used = m["slots_used"]
        self.metrics_label.value = (
            f"policy <b>{html.escape(str(m['policy']))}</b> · slots used <b data-slots-used='{used}'>"
            f"{used}</b>/{m['slots']} · queued {m['queued']} · running {m['running']} · "
            f"paused {m['paused']} · finished {m['finished']} · failed {m['failed']} · "
            f"dropped {m['dropped']} · avg JCT {avg} · restart cost {m['restart_cost_s']:.2f}s")
        for ev in cl.events(self._n_events):
            self._n_events += 1
            if ev["kind"] in _LOGGED:
                fields = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in ev.items() if k not in ("kind", "time", "t", "entrypoint")
                                   and v is not None)
                style = " style='color:#c00'" if ev["kind"] in ("refused", "drop", "failed", "error") else ""
                self._append(f"{ev['t']:.1f}s <b{style}>{ev['kind']}</b> {html.escape(fields)}")
        hist = cl.history()
        if len(hist) != self._n_history:
            self._n_history = len(hist)
            times, names, z = self.slots_matrix()
            if times:  # extend the last column to now, so the current allocation shows
                times = [*times, cl.now()]
                z = [[*row, row[-1]] for row in z]
            with self.figure.batch_update():
                hm = self.figure.data[0]
                hm.x, hm.y, hm.z = times, names, z
                self.figure.layout.height = self._height(len(names))
            self.chart.show()



