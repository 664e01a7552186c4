"""Plotly figures of simulation results, one function per view (issue 19): job-completion-time CDFs, GPU
utilisation over time and queueing delay (first placement minus submission) per policy, and the table of
what scheduling papers report (average / p99 JCT, makespan, utilisation, queueing). Each takes
``{policy: SimResult}``; long runs are binned so a whole trace draws quickly."""
from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["jct_cdf", "jct_cdf_figure", "utilisation_figure", "queueing_figure", "results_table",
           "TABLE_COLUMNS"]

TABLE_COLUMNS = ["jobs", "completed", "avg_jct", "p99_jct", "makespan", "gpu_utilisation",
                 "avg_queue_delay", "restarts"]
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _cdf(values, max_points: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(np.asarray(values, dtype=float))
    x = x[np.isfinite(x)]
    y = np.arange(1, len(x) + 1) / max(len(x), 1)
    if len(x) > max_points:  # evenly spaced quantiles keep the shape
        k = np.unique(np.linspace(0, len(x) - 1, max_points).astype(int))
        x, y = x[k], y[k]
    return x, y


def jct_cdf(result) -> tuple[np.ndarray, np.ndarray]:
    """Sorted job completion times (hours) and their empirical CDF."""
    return _cdf(np.asarray(result.jcts, dtype=float) / 3600.0, max_points=10**9)


def _figure(title, xaxis, yaxis, log_x=False):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis, template="plotly_white",
                      legend={"orientation": "h", "y": -0.2}, height=380)
    if log_x:
        fig.update_xaxes(type="log")
    return fig


def jct_cdf_figure(results: dict, log_x: bool = True):
    """CDF of job completion times (hours) per policy."""
    fig = _figure("Job completion time CDF", "JCT (hours)", "fraction of jobs", log_x)
    for i, (pol, res) in enumerate(results.items()):
        x, y = _cdf(res.jcts / 3600.0)
        fig.add_scatter(x=x, y=y, mode="lines", name=pol, line={"color": _COLORS[i % 8], "shape": "hv"})
    fig.update_yaxes(range=[0, 1.02])
    return fig


def _binned(t, y, max_points):
    if len(t) <= max_points:
        return t, y
    edges = np.linspace(t[0], t[-1], max_points + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, max_points - 1)
    n = np.bincount(idx, minlength=max_points)
    s = np.bincount(idx, weights=y, minlength=max_points)
    ok = n > 0
    return ((edges[:-1] + edges[1:]) / 2)[ok], s[ok] / n[ok]


def utilisation_figure(results: dict, max_points: int = 3000):
    """Share of the cluster's GPUs allocated over time (hours) per policy, bin means for long runs."""
    fig = _figure("GPU utilisation", "time (hours)", "GPUs allocated (share)")
    for i, (pol, res) in enumerate(results.items()):
        u = res.utilisation
        x, y = _binned(u.time.to_numpy(float) / 3600.0, u.utilisation.to_numpy(float), max_points)
        fig.add_scatter(x=x, y=y, mode="lines", name=pol, line={"color": _COLORS[i % 8], "width": 1})
    fig.update_yaxes(range=[0, 1.02])
    return fig


def queueing_figure(results: dict):
    """CDF of queueing delay (hours from submission to first GPUs) per policy."""
    fig = _figure("Queueing delay CDF", "queueing delay (hours)", "fraction of jobs")
    for i, (pol, res) in enumerate(results.items()):
        q = res.jobs.get("queue_delay", pd.Series(dtype=float)).to_numpy(float) / 3600.0
        x, y = _cdf(q)
        fig.add_scatter(x=x, y=y, mode="lines", name=pol, line={"color": _COLORS[i % 8], "shape": "hv"})
    fig.update_yaxes(range=[0, 1.02])
    return fig


def results_table(results: dict) -> pd.DataFrame:
    """One row per policy: :data:`TABLE_COLUMNS` of the summaries (seconds; utilisation a share)."""
    rows = [{"policy": p, **{k: r.summary.get(k, np.nan) for k in TABLE_COLUMNS}} for p, r in results.items()]
    return pd.DataFrame(rows, columns=["policy", *TABLE_COLUMNS]).set_index("policy")
