"""Static figure export (PNG, SVG, PDF) of plotly figures for reports and papers, and readable log axes
(:func:`log_axis`).

plotly renders through kaleido 1.x, which drives a local Chromium. On Debian that is ``/usr/bin/chromium``
(``apt-get install chromium``); kaleido finds it by itself, and :func:`find_chromium` points it there
explicitly through ``BROWSER_PATH``. Nothing here downloads a browser (never ``plotly_get_chrome``).
A long export session keeps one Chromium alive with :func:`start_export_server` (~0.2 s per image
instead of ~3 s).
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

FORMATS = ("png", "svg", "pdf", "jpeg", "webp")
_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
_server_started = False


def log_axis(values) -> dict:
    """Settings for a log axis over ``values`` (``fig.update_yaxes(**log_axis(y))``) with ticks at 1, 2, 5
    times powers of ten, labelled in full (plotly's own log ticks label 20 and 30 as "2" and "3").
    Values that are not finite and positive are ignored; none left: a plain log axis."""
    import math

    v = [float(x) for x in values if x is not None and math.isfinite(float(x)) and float(x) > 0]
    if not v:
        return {"type": "log"}
    lo, hi = math.floor(math.log10(min(v))), math.ceil(math.log10(max(v)))
    ticks = [m * 10.0**e for e in range(lo, hi + 1) for m in (1, 2, 5)
             if min(v) / 2 <= m * 10.0**e <= max(v) * 2]
    if len(ticks) > 10:  # a wide range: powers of ten only
        ticks = [10.0**e for e in range(lo, hi + 1)]
    return {"type": "log", "tickvals": ticks, "ticktext": [f"{t:,.10g}" for t in ticks]}


def find_chromium() -> str | None:
    """Path of a local Chromium/Chrome usable by kaleido, or ``None`` (``BROWSER_PATH`` wins if set)."""
    env = os.environ.get("BROWSER_PATH")
    if env and os.path.exists(env):
        return env
    for path in _CANDIDATES:
        if os.path.exists(path):
            return path
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def can_export() -> bool:
    """True when kaleido is importable and a local Chromium exists."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return find_chromium() is not None


def _require_browser() -> str:
    path = find_chromium()
    if path is None:
        raise RuntimeError("static export needs a local Chromium: install Debian's package "
                           "(apt-get install -y chromium); elasticlab never downloads one")
    try:
        import kaleido  # noqa: F401
    except ImportError as e:
        raise RuntimeError("static export needs kaleido>=1.0 (pip install kaleido)") from e
    os.environ.setdefault("BROWSER_PATH", path)
    return path


def start_export_server() -> None:
    """Keep one kaleido Chromium running for the process, so many exports are fast."""
    global _server_started
    if _server_started:
        return
    _require_browser()
    import kaleido

    kaleido.start_sync_server(silence_warnings=True)
    _server_started = True


def stop_export_server() -> None:
    """Stop the Chromium started by :func:`start_export_server` (no-op if none)."""
    global _server_started
    if not _server_started:
        return
    import kaleido

    kaleido.stop_sync_server(silence_warnings=True)
    _server_started = False


def save_figure(fig, path, *, width: int = 900, height: int = 500, scale: float = 1.0,
                format: str | None = None) -> Path:
    """Write ``fig`` (a plotly Figure, FigureWidget or figure dict) to ``path`` as a static image.

    The format comes from ``format`` or the file suffix (one of :data:`FORMATS`). Parent folders are
    created. The file is written to a temporary name first and renamed, so a failed export leaves no
    half-written image. Returns the path.
    """
    import plotly.graph_objects as go
    import plotly.io as pio

    path = Path(path)
    fmt = (format or path.suffix.lstrip(".")).lower()
    if fmt == "jpg":
        fmt = "jpeg"
    if fmt not in FORMATS:
        raise ValueError(f"unsupported image format {fmt!r} for {str(path)!r}; use one of {FORMATS}")
    for name, v in (("width", width), ("height", height), ("scale", scale)):
        if not v or v <= 0:
            raise ValueError(f"{name} must be positive, got {v!r}")
    if isinstance(fig, dict):
        fig = go.Figure(fig)
    elif not isinstance(fig, go.Figure):  # FigureWidget is a subclass of BaseFigure, not Figure
        to_dict = getattr(fig, "to_dict", None)
        if to_dict is None:
            raise TypeError(f"expected a plotly figure, got {type(fig).__name__}")
        fig = go.Figure(to_dict())
    _require_browser()
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # plotly warns that per-call options are ignored by a running server
        warnings.filterwarnings("ignore", message="The kopts argument is ignored")
        data = pio.to_image(fig, format=fmt, width=int(width), height=int(height), scale=scale)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def save_figures(figs: dict, folder, *, format: str = "png", **kw) -> dict[str, Path]:
    """Export several figures ``{name: fig}`` into ``folder`` as ``name.format``, reusing one Chromium."""
    if not figs:
        return {}
    start_export_server()
    try:
        return {name: save_figure(fig, Path(folder) / f"{name}.{format}", **kw) for name, fig in figs.items()}
    finally:
        stop_export_server()
