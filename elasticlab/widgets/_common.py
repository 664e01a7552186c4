"""Helpers shared by the control panels: quick mode, a background poller, small plotly/ipywidgets pieces."""
from __future__ import annotations

import contextlib
import html
import json
import os
import tempfile
import threading
import traceback
from pathlib import Path

# plotly's figure classes (and narwhals, which they import) now, on the thread importing a panel's module,
# before any panel or cluster starts a thread: loaded lazily inside a ClusterPanel built just after a Ray
# cluster started, while another thread of the process was importing narwhals too (scikit-learn imports it
# as well), the two imports met in Python's module locks and raised _DeadlockError (notebook 08, CI,
# 2026-11-28).
from plotly.graph_objects import Figure as _Figure  # noqa: F401

from elasticlab.checks import seconds

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


def chart_backend() -> str:
    """How panels draw live charts: ``"figurewidget"`` (plotly's ``go.FigureWidget``, the default) or
    ``"output"`` (a plotly mime bundle in an ``ipywidgets.Output``; ``ELASTICLAB_CHARTS=output``), for
    front ends without the anywidget extension (e.g. some notebook viewers)."""
    v = os.environ.get("ELASTICLAB_CHARTS", "figurewidget").strip().lower()
    if v not in ("figurewidget", "output"):
        raise ValueError(f"ELASTICLAB_CHARTS must be 'figurewidget' or 'output', got {v!r}")
    return v


class LiveFigure:
    """A live plotly chart that panels edit from any thread.

    By default ``figure`` becomes a ``go.FigureWidget`` (anywidget front end): edits made under
    ``figure.batch_update()`` reach the browser as one message, and :meth:`show` has nothing to do.
    With ``backend="output"`` ``figure`` stays an ordinary ``go.Figure`` shown in an ``ipywidgets.Output``
    whose plotly mime bundle :meth:`show` replaces after each edit.
    """

    def __init__(self, figure, backend: str | None = None, **layout):
        import ipywidgets as W
        import plotly.graph_objects as go

        self.backend = backend or chart_backend()
        if self.backend == "figurewidget":
            self.figure = go.FigureWidget(figure)
            self.widget = W.Box([self.figure], layout=W.Layout(**layout)) if layout else self.figure
        elif self.backend == "output":
            self.figure = figure
            self.widget = W.Output(layout=W.Layout(**layout)) if layout else W.Output()
            self.show()
        else:
            raise ValueError(f"backend must be 'figurewidget' or 'output', got {self.backend!r}")

    def show(self) -> None:
        """Push the current figure to the browser (FigureWidget: already synced, nothing to do)."""
        if self.backend == "figurewidget":
            return
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
        if v is None:
            return "–"
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
    # A temporary file of its own per call: the kernel thread and a panel's poller may write at once.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(obj, default=str))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Poller:
    """Call ``fn()`` every ``interval_s`` seconds on a daemon thread until :meth:`stop` (or ``fn`` returns
    False). Exceptions are kept in :attr:`error` (and passed to ``on_error``) instead of killing the thread,
    so a UI keeps updating; the kernel is never blocked."""

    def __init__(self, fn, interval_s: float = 0.5, *, name: str = "elasticlab-poller", on_error=None):
        self.fn, self.interval_s, self.on_error = fn, seconds("interval_s", interval_s), on_error
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


class Panel:
    """What every panel shares: it shows its ``widget`` when a notebook displays it."""

    widget = None

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


class PolledPanel(Panel):
    """A panel refreshed by a :class:`Poller` (``self._poller``), stopped by :meth:`close` or when the panel
    is garbage-collected; what it watches keeps running."""

    _poller: Poller | None = None

    def _start_polling(self, poll_s: float, name: str, log, autostart: bool) -> None:
        """Make the poller of ``self.refresh`` (an error's last line goes to ``log`` in red), refresh once,
        and start it with ``autostart``."""
        self._poller = Poller(self.refresh, poll_s, name=name,
                              on_error=lambda tb: log(f"<span style='color:#c00'>panel error: "
                                                      f"{html.escape(tb.splitlines()[-1])}</span>"))
        self.refresh()
        if autostart:
            self._poller.start()

    def close(self) -> None:
        """Stop refreshing (what the panel watches keeps running)."""
        if self._poller is not None:
            self._poller.stop()

    def __del__(self):
        try:
            if self._poller is not None:
                self._poller.stop(timeout=0)
        except Exception:
            pass
