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


def figure_widget(title: str, *, height: int = 260, xaxis: str = "", yaxis: str = "", **layout):
    """An empty plotly ``FigureWidget`` with a compact layout (the live charts of the panels)."""
    import plotly.graph_objects as go

    fig = go.FigureWidget()
    fig.update_layout(title={"text": title, "x": 0.02, "font": {"size": 13}}, height=height,
                      margin={"l": 50, "r": 15, "t": 35, "b": 35}, xaxis_title=xaxis, yaxis_title=yaxis,
                      template="plotly_white", showlegend=False, **layout)
    return fig


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
