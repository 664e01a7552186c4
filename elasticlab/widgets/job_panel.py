"""JobPanel: start, pause, resize and stop a live :class:`~elasticlab.elastic.ElasticJob` from JupyterLab.

A worker-count slider resizes the running job (``job.resize(n)``, applied at the next step boundary), a
batch-policy choice replaces the job's policy (used at the next resize), and an LR-rule choice applies
before the job starts (the workers carry the rule). Six plotly charts — loss, samples/s, gradient noise
scale, global batch, LR and world size over time, with every new generation (resize, restart, resume)
marked — and an event log are refreshed by a background thread polling ``job.metrics()``/``job.events()``,
so the kernel is never blocked. (The charts are one plotly ``FigureWidget``, see
:class:`~elasticlab.widgets._common.LiveFigure`.)
"""
from __future__ import annotations

import html
import time

import ipywidgets as W

from elasticlab.checks import seconds, whole
from elasticlab.elastic.states import TERMINAL, JobState, WorkerState
from elasticlab.widgets._common import LiveFigure, PolledPanel, subplots_figure, write_json_atomic

#: The charts: (metric key, title, y-axis label, step-shaped line?, tick format). Whole-number series
#: (batch, workers) tick at integers; every axis starts at 0 and its range is set from the data, so a
#: constant series (an LR of 0.05) is drawn against [0, 0.06], not plotly's empty-axis -1..1.
CHARTS = (("loss", "Loss", "loss", False, ".3~g"), ("samples_per_s", "Throughput", "samples/s", False, "~s"),
          ("gns", "Gradient noise scale", "B_noise (samples)", False, "~s"),
          ("global_batch", "Global batch", "samples", True, "d"),
          ("lr", "Learning rate", "LR", True, ".3~g"), ("world_size", "World size", "workers", True, "d"))
#: Events that change the job's shape and are drawn as vertical lines.
MARKED = ("generation",)
#: Events written to the log (kinds of :data:`elasticlab.elastic.records.EVENT_KINDS`).
LOGGED = ("start", "generation", "resize", "set_batch", "checkpoint_corrupt", "resume", "pause", "resumed",
          "fault", "restart", "record_gap", "finished", "stop", "error")
#: States in which the pause button pauses the job.
_PAUSABLE = (JobState.STARTING, JobState.SPAWNING, JobState.RUNNING, JobState.DRAINING)


def y_range(values, whole: bool = False) -> list[float] | None:
    """[0, top] for a series of values >= 0 (None: no finite value, or a negative one, left to plotly):
    top is 15% above the largest value, a whole number for whole-number series (ticks at integers)."""
    finite = [v for v in values if v == v and v not in (float("inf"), float("-inf"))]
    if not finite or min(finite) < 0:
        return None
    top = max(finite) * 1.15 or 1.0
    return [0, float(int(top) + 1) if whole else top]


def batch_policies() -> tuple[str, ...]:
    """The batch-policy choices: the registry :data:`elasticlab.elastic.policies.POLICIES`, in its order."""
    from elasticlab.elastic.policies import POLICIES

    return tuple(POLICIES)


def lr_rules() -> tuple[str, ...]:
    """The LR-rule choices: the job rules of the registry :data:`elasticlab.lr.RULES`, in order."""
    from elasticlab.elastic.scaling import lr_rules as rules

    return rules()


def __getattr__(name):  # ``BATCH_POLICIES`` and ``LR_RULES``, read from the registries when asked
    if name == "BATCH_POLICIES":
        return batch_policies()
    if name == "LR_RULES":
        return lr_rules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_policy(name: str, global_batch: int, world_size: int, max_batch: int | None = None):
    """A batch policy of :mod:`elasticlab.elastic.policies` by name, sized from the job's current batch."""
    from elasticlab.elastic.policies import make_batch_policy

    return make_batch_policy(name, global_batch, world_size, max_batch)


class JobPanel(PolledPanel):
    """Control panel of one :class:`~elasticlab.elastic.ElasticJob` (display it as the last line of a cell).

    ``max_workers`` bounds the slider (default: the job's slots, at most 8). ``poll_s`` is the refresh
    period. ``status_file``, if given, receives ``job.status()`` as JSON at every refresh (for scripts and
    tests that watch a job driven from the browser). ``window`` keeps the charts to the last that many steps;
    they are redrawn at most every ``chart_every_s`` with at most ``max_points`` points per series.
    """

    def __init__(self, job, *, max_workers: int | None = None, poll_s: float = 0.5, status_file=None,
                 window: int = 5000, chart_every_s: float = 2.0, max_points: int = 400,
                 autostart_poll: bool = True):
        for name in ("start", "resize", "pause", "resume", "stop", "status", "metrics", "events"):
            if not callable(getattr(job, name, None)):
                raise TypeError(f"JobPanel needs an ElasticJob-like object; "
                                f"{type(job).__name__} has no {name}()")
        seconds("poll_s", poll_s)
        self.job = job
        self.status_file = status_file
        self.window = whole("window", window, 10, "a whole number of steps >= 10")
        self.chart_every_s = seconds("chart_every_s", chart_every_s, zero_ok=True)
        self.max_points = whole("max_points", max_points, 10)
        self._last_chart = 0.0
        self._chart_stale = False
        slots = int(getattr(job, "slots", 8))
        self.max_workers = int(max_workers) if max_workers is not None else max(1, min(slots, 8))
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers!r}")
        st = job.status()
        self._t0: float | None = None
        self._n_metrics = 0
        self._n_events = 0
        self._series: dict[str, list] = {k: [] for k, *_ in CHARTS}
        self._series["t"] = []
        self._marks: list[tuple[float, str]] = []
        self._log: list[str] = []
        self._last_state = None

        # ---- controls -------------------------------------------------------------------------
        n0 = max(1, min(int(st.get("target_world_size") or getattr(job, "world_size", 1)), self.max_workers))
        self.workers = W.IntSlider(value=n0, min=1, max=self.max_workers, step=1, description="workers",
                                   continuous_update=False, layout=W.Layout(width="320px"))
        self.workers.add_class("elasticlab-workers")
        self.start_button = W.Button(description="start", icon="play", button_style="success",
                                     layout=W.Layout(width="90px"))
        self.pause_button = W.Button(description="pause", icon="pause", layout=W.Layout(width="100px"))
        self.stop_button = W.Button(description="stop", icon="stop", button_style="danger",
                                    layout=W.Layout(width="90px"))
        from elasticlab.elastic.policies import FixedGlobalBatch, batch_policy_name

        # a job without a policy keeps its global batch: FixedGlobalBatch, with its LR rule
        pol_name = batch_policy_name(getattr(job, "policy", None), batch_policy_name(FixedGlobalBatch))
        self.policy = W.Dropdown(options=batch_policies(), value=pol_name, description="batch",
                                 layout=W.Layout(width="230px"))
        default_rule = FixedGlobalBatch.lr_rule
        rule, rules = getattr(job, "options", {}).get("lr_rule", default_rule), lr_rules()
        self.lr_rule = W.Dropdown(options=rules, value=rule if rule in rules else default_rule,
                                  description="LR rule", layout=W.Layout(width="230px"))
        self.status_label = W.HTML(value="")
        self.status_label.add_class("elasticlab-job-status")
        self.log = W.HTML(value="", layout=W.Layout(max_height="160px", overflow="hidden auto",
                                                    border="1px solid #ddd", padding="2px 6px"))
        self.log.add_class("elasticlab-job-log")

        self.start_button.on_click(lambda _: self.start())
        self.pause_button.on_click(lambda _: self.toggle_pause())
        self.stop_button.on_click(lambda _: self.stop(block=False))
        self.workers.observe(self._on_workers, names="value")
        self.policy.observe(self._on_policy, names="value")
        self.lr_rule.observe(self._on_lr_rule, names="value")

        # ---- charts: a 2x3 grid of subplots, redrawn on every refresh with new data ---------------
        fig = subplots_figure([title for _, title, *_ in CHARTS], rows=2, cols=3, height=540,
                              horizontal_spacing=0.11, vertical_spacing=0.2)
        for i, (key, _, ylab, stepped, fmt) in enumerate(CHARTS):
            r, c = divmod(i, 3)
            fig.add_scatter(x=[], y=[], mode="lines", name=key, row=r + 1, col=c + 1,
                            line={"shape": "hv" if stepped else "linear", "width": 2})
            # short tick labels and a title set off from them: the ticks of the next column's axis
            # were drawn over this one's title
            fig.update_yaxes(title_text=ylab, title_standoff=4, tickformat=fmt, nticks=6, rangemode="tozero",
                             row=r + 1, col=c + 1)
        fig.update_xaxes(title_text="time since start (s)", row=2)
        self.chart = LiveFigure(fig)
        self.figure = self.chart.figure
        controls = W.HBox([self.start_button, self.pause_button, self.stop_button, self.workers])
        choices = W.HBox([self.policy, self.lr_rule])
        self.widget = W.VBox([W.HTML("<b>elasticlab · elastic job</b>"), controls, choices,
                              self.status_label, self.chart.widget, W.HTML("<b>events</b>"), self.log])
        self.widget.add_class("elasticlab-job-panel")
        self._start_polling(poll_s, "elasticlab-jobpanel", self._append_log, autostart_poll)

    # ---- actions -------------------------------------------------------------------------------
    def start(self):
        """Start the job (if new)."""
        if self.job.status()["state"] == JobState.NEW:
            self.job.start()
        self.refresh()
        return self

    def resize(self, n: int):
        """Resize the job to ``n`` workers (moves the slider, which requests the resize)."""
        if int(n) != n or not 1 <= n <= self.max_workers:
            raise ValueError(f"workers must be an integer in [1, {self.max_workers}], got {n!r}")
        if self.workers.value == n:
            return self.job.resize(int(n))
        self.workers.value = int(n)
        return self._last_request

    def toggle_pause(self):
        state = self.job.status()["state"]
        if state == JobState.PAUSED:
            self._last_request = self.job.resume(self.workers.value)
        elif state in _PAUSABLE:
            self._last_request = self.job.pause()
        return self._last_request

    def stop(self, block: bool = True):
        """Stop the job (checkpoint and end its workers). ``block=False`` does it on a helper thread."""
        if block:
            self.job.stop()
            self.refresh(force=True)
        else:
            import threading

            threading.Thread(target=lambda: (self.job.stop(), self.refresh(force=True)), daemon=True).start()


    def wait_until(self, predicate, timeout: float = 60.0, interval: float = 0.1) -> dict:
        """Block until ``predicate(job.status())`` holds; returns that status (TimeoutError otherwise).

        For scripted runs (a notebook in CI); interactive use never needs it."""
        end = time.monotonic() + timeout
        while True:
            st = self.job.status()
            if predicate(st):
                self.refresh()
                return st
            if time.monotonic() > end:
                raise TimeoutError(f"condition not reached in {timeout} s; last status: "
                                   f"state={st['state']!r}, world_size={st['world_size']}, step={st['step']}")
            time.sleep(interval)

    # ---- widget callbacks ------------------------------------------------------------------------
    _last_request = None

    def _on_workers(self, change):
        n = int(change["new"])
        try:
            self._last_request = self.job.resize(n)
            self._append_log(f"requested resize to {n} workers" + self._spawn_note(n))
        except Exception as e:  # a bad size must not kill the widget
            self._append_log(f"<span style='color:#c00'>resize failed: {html.escape(str(e))}</span>")

    def _on_policy(self, change):
        from elasticlab.elastic.policies import GoodputAdaptive

        st = self.job.status()
        batch = st.get("global_batch") or getattr(getattr(self.job, "policy", None), "global_batch", None) \
            or getattr(self.job, "entry_kwargs", {}).get("base_batch", 32)
        n = max(1, st.get("world_size") or self.workers.value)
        pol = make_policy(change["new"], batch, n)
        self.job.policy = pol  # the controller sizes every later generation (resize, restart) with it
        if st["state"] == JobState.NEW:
            self.lr_rule.value = getattr(pol, "lr_rule", self.lr_rule.value)
            self._append_log(f"batch policy → {html.escape(repr(pol))} (used from the start)")
            return
        # sized from the current batch, a policy keeps it at the current size; what changes is the batch at
        # other sizes, from the next resize on: show it
        try:
            sizes = ", ".join(f"{k}: {pol.decide(k, None).global_batch}"
                              for k in range(1, self.max_workers + 1))
        except Exception as e:  # a policy that needs statistics it has not seen yet
            sizes = f"unknown until it has statistics ({e})"
        rule = self.job.options.get("lr_rule") if hasattr(self.job, "options") else None
        self._append_log(f"batch policy → {html.escape(repr(pol))}: global batch {st.get('global_batch')} "
                         f"now; from the next resize, by workers {html.escape(sizes)}"
                         + (" (adapted to the measured noise scale while it runs)"
                            if isinstance(pol, GoodputAdaptive) else "")
                         + (f"; the LR rule stays {html.escape(str(rule))} (the workers carry it)" if rule
                            else ""))

    def _on_lr_rule(self, change):
        if self.job.status()["state"] != JobState.NEW:
            self._append_log("the LR rule is fixed once the job runs (workers carry it)")
            return
        self.job.options["lr_rule"] = change["new"]
        self._append_log(f"LR rule → {change['new']}")

    def _spawn_note(self, n: int) -> str:
        """Why growing past the warm worker processes is slower: the new ones must start first."""
        workers = self.job.status().get("workers") or {}
        alive = sum(1 for w in workers.values() if w.get("state") != WorkerState.DEAD)
        if not workers or n <= alive:
            return ""
        k = n - alive
        return (f" — {k} more worker process{'es' if k > 1 else ''} beyond the {alive} warm one"
                f"{'s' if alive != 1 else ''} must start (fork, import torch) before the group re-forms: "
                f"expect about 2 s more than a resize within the warm ones (the job's <code>warm=</code>)")

    # ---- refresh ---------------------------------------------------------------------------------
    def _append_log(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self._log.append(f"<div><code>{stamp}</code> {line}</div>")
        self._log = self._log[-200:]
        self.log.value = "".join(reversed(self._log))

    @staticmethod
    def _describe(ev: dict) -> str:
        k = ev["kind"]
        if k == "resume":  # a generation's workers loaded the state it formed from
            k = "restored" if ev.get("step") else "initialised"
        skip = {"kind", "time", "t", "path", "port", "entrypoint", "workers", "checkpoint"}
        fields = ", ".join(f"{a}={v:.3g}" if isinstance(v, float) else f"{a}={v}"
                           for a, v in ev.items() if a not in skip and v is not None)
        style = " style='color:#c00'" if k in ("fault", "error", "restart", "checkpoint_corrupt") else ""
        return f"<b{style}>{html.escape(k)}</b> {html.escape(fields)}"

    def refresh(self, force: bool = False) -> None:
        """Pull new metrics and events from the job and update the charts, log and status (thread-safe
        enough for one poller: only this method writes the series)."""
        job = self.job
        new = job.metrics(self._n_metrics)
        evs = job.events(self._n_events)
        self._n_metrics += len(new)
        self._n_events += len(evs)
        for ev in evs:
            if self._t0 is None:
                self._t0 = ev["time"]
            if ev["kind"] in MARKED:
                self._marks.append((ev["time"] - self._t0, f"{ev.get('world_size', '?')}w"))
            if ev["kind"] in LOGGED:
                self._append_log(self._describe(ev))
        if new:
            if self._t0 is None:
                self._t0 = new[0]["time"]
            for r in new:
                self._series["t"].append(r["time"] - self._t0)
                for key, *_ in CHARTS:
                    v = r.get(key)
                    self._series[key].append(float("nan") if v is None else v)
            if len(self._series["t"]) > self.window:
                for k in self._series:
                    self._series[k] = self._series[k][-self.window:]
        st = job.status()
        self._chart_stale |= bool(new or evs)
        # charts are redrawn at most every chart_every_s (a browser on a busy machine must keep up)
        if self._chart_stale and (force or time.monotonic() - self._last_chart >= self.chart_every_s):
            self._last_chart = time.monotonic()
            self._chart_stale = False
            self._draw(st)
        self._show_status(st)
        if self.status_file:
            write_json_atomic(self.status_file,
                              {**st, "panel_time": time.time(), "panel_steps": self._n_metrics})
        return None

    def _draw(self, st: dict) -> None:
        n = len(self._series["t"])
        keep = list(range(0, n, max(1, -(-n // self.max_points))))
        if n and keep[-1] != n - 1:
            keep.append(n - 1)
        t = [self._series["t"][i] for i in keep]
        axes = [("x", "y")] + [(f"x{i + 1}", f"y{i + 1}") for i in range(1, len(CHARTS))]
        shapes = [{"type": "line", "xref": ax, "yref": f"{ay} domain", "x0": x, "x1": x, "y0": 0, "y1": 1,
                   "line": {"color": "rgba(120,120,120,0.6)", "dash": "dot", "width": 1}}
                  for x, _ in self._marks for ax, ay in axes]
        fig = self.figure
        with fig.batch_update():
            for i, (key, title, _, _, fmt) in enumerate(CHARTS):
                full = self._series[key]
                ys = [full[i] for i in keep]
                last = next((y for y in reversed(full) if y == y), None)
                fig.data[i].x = t
                fig.data[i].y = ys
                fig.layout.annotations[i].text = title if last is None else f"{title} (now {last:.4g})"
                axis = fig.layout["yaxis" if i == 0 else f"yaxis{i + 1}"]
                axis.range = y_range(full, whole=fmt == "d")
                axis.dtick = 1 if key == "world_size" else None
            fig.layout.shapes = shapes
        self.chart.show()

    def _show_status(self, st: dict) -> None:
        state = st["state"]
        paused, new = state == JobState.PAUSED, state == JobState.NEW
        self.pause_button.description = "resume" if paused else "pause"
        self.pause_button.icon = "play" if paused else "pause"
        terminal = state in TERMINAL
        self.start_button.disabled = not new
        self.pause_button.disabled = terminal or new
        self.stop_button.disabled = terminal
        self.workers.disabled = terminal
        self.lr_rule.disabled = not new
        gb = st.get("global_batch")
        parts = [f"state=<b data-state='{state}'>{state}</b>",
                 f"world_size=<b data-world-size='{st['world_size']}'>{st['world_size']}</b>",
                 f"target={st.get('target_world_size')}", f"step={st['step']}", f"epoch={st.get('epoch')}",
                 f"global_batch={gb}", f"per_worker={st.get('per_worker_batch')}",
                 f"accum={st.get('accum_steps')}", f"generation={st.get('generation')}"]
        if st.get("lost_steps"):
            parts.append(f"lost_steps={st['lost_steps']}")
        if st.get("error"):
            parts.append(f"<span style='color:#c00'>error: {html.escape(str(st['error']))}</span>")
        self.status_label.value = " · ".join(parts)
        self._last_state = state


