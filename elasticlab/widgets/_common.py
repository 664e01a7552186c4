"""Helpers shared by the control panels: quick mode, a background poller, small plotly/ipywidgets pieces."""
from __future__ import annotations

import html
import json
import os
import threading
import traceback
from pathlib import Path

#: Colours per policy / series, so a policy has the same colour in every chart of a panel.
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")


def quick_mode() -> bool:
    """True when ``ELASTICLAB_QUICK=1`` (CI's short runs of the notebooks)."""
    return os.environ.get("ELASTICLAB_QUICK", "0").strip().lower() in ("1", "true", "yes", "on")


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def subplots_figure(titles, rows: int, cols: int, *, height: int = 500, **kw):
    """A plotly figure with a grid of titled subplots in the panels' compact style."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=rows, cols=cols, subplot_titles=list(titles), **kw)
    fig.update_layout(height=height, margin={"l": 55, "r": 15, "t": 40, "b": 45}, template="plotly_white",
                      showlegend=False)
    fig.update_annotations(font_size=13)
    return fig


class LiveFigure:
    """A plotly figure shown in an ``ipywidgets.Output`` and redrawn by :meth:`show` (from any thread).

    The panels draw their charts this way rather than with ``go.FigureWidget``: with plotly 7's anywidget
    front end, FigureWidgets edited before or while the browser creates their view came up blank in
    JupyterLab 4 (see tests/test_browser.py), whereas replacing the output's plotly mime bundle (rendered
    by the jupyterlab-plotly extension) always shows the current figure. ``figure`` is an ordinary
    ``go.Figure``: edit it, then call :meth:`show`.
    """

    def __init__(self, figure, **layout):
        import ipywidgets as W

        self.figure = figure
        self.widget = W.Output(layout=W.Layout(**layout)) if layout else W.Output()
        self.show()

    def show(self) -> None:
        import plotly.io as pio

        spec = json.loads(pio.to_json(self.figure, validate=False))
        spec["config"] = {"displaylogo": False, "responsive": True}
        self.widget.outputs = ({"output_type": "display_data", "metadata": {},
                                "data": {"application/vnd.plotly.v1+json": spec,
                                         "text/plain": f"<plotly figure: {len(self.figure.data)} traces>"}},)


def html_table(rows: list[dict], columns: list[str] | None = None, *, floatfmt: str = "{:.4g}") -> str:
    """A small HTML table (for an ``ipywidgets.HTML``) from a list of dicts."""
    if not rows:
        return "<i>(empty)</i>"
    columns = columns or list(rows[0])

    def cell(v):
        if isinstance(v, float):
            return floatfmt.format(v)
        return html.escape(str(v))

    head = "".join(f"<th style='padding:2px 8px;text-align:right'>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px;text-align:right'>{cell(r.get(c, ''))}</td>"
                                    for c in columns) + "</tr>" for r in rows)
    return f"<table style='border-collapse:collapse;font-size:12px'><tr>{head}</tr>{body}</table>"


def write_json_atomic(path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file and a rename (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, default=str))
    os.replace(tmp, path)


class Poller:
    """Call ``fn()`` every ``interval_s`` seconds on a daemon thread until :meth:`stop` (or ``fn`` returns
    False). Exceptions are kept in :attr:`error` (and passed to ``on_error``) instead of killing the thread,
    so a UI keeps updating; the kernel is never blocked."""

    def __init__(self, fn, interval_s: float = 0.5, *, name: str = "elasticlab-poller", on_error=None):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.fn, self.interval_s, self.on_error = fn, float(interval_s), on_error
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.fn() is False:
                    return
            except Exception:
                self.error = traceback.format_exc()
                if self.on_error is not None:
                    try:
                        self.on_error(self.error)
                    except Exception:
                        pass
            self._stop.wait(self.interval_s)

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
