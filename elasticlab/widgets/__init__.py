"""Jupyter control panels (ipywidgets + plotly FigureWidget), one module per panel.

Imported lazily so that ``import elasticlab.widgets`` stays cheap and a panel's heavy dependencies load
only when it is used.
"""
from __future__ import annotations

import importlib

_PANELS = {
    "JobPanel": "job_panel",
    "AllocationExplorer": "allocation",
    "SimulationDashboard": "simulation",
    "DynamicsExplorer": "dynamics",
    "ClusterPanel": "cluster",
}

__all__ = sorted(_PANELS)


def __getattr__(name: str):
    if name in _PANELS:
        return getattr(importlib.import_module(f"{__name__}.{_PANELS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
