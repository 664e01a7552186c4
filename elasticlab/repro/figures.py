"""Small plotly figure builders shared by the claim modules (one look for the whole report)."""

from __future__ import annotations

import numpy as np

PASS_COLOR, FAIL_COLOR, REF_COLOR = "#2a9d8f", "#e76f51", "#264653"


def _layout(fig, title, xaxis, yaxis, log_x=False, log_y=False):
    fig.update_layout(
        title=title,
        template="plotly_white",
        height=380,
        margin=dict(l=60, r=20, t=50, b=50),
        legend=dict(orientation="h", y=-0.2),
    )
    fig.update_xaxes(title_text=xaxis, type="log" if log_x else None)
    fig.update_yaxes(title_text=yaxis, type="log" if log_y else None)
    return fig


def bars(
    labels,
    values,
    *,
    title,
    yaxis="",
    target=None,
    target_label="target",
    ok=None,
    log_y=False,
    reference=None,
    reference_label="paper / calibration",
):
    """Measured values as bars (coloured by ``ok`` per bar), with a horizontal target line and optional
    reference values (e.g. the paper's numbers) as markers."""
    import plotly.graph_objects as go

    labels = [str(v) for v in labels]
    values = [float(v) for v in values]
    colors = [PASS_COLOR if (ok is None or o) else FAIL_COLOR for o in (ok if ok is not None else values)]
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=values,
            marker_color=colors,
            name="measured",
            text=[f"{v:.3g}" for v in values],
            textposition="outside",
        )
    )
    if reference is not None:
        fig.add_trace(
            go.Scatter(
                x=labels,
                y=[float(v) for v in reference],
                mode="markers",
                name=reference_label,
                marker=dict(symbol="diamond", size=11, color=REF_COLOR),
            )
        )
    if target is not None:
        fig.add_hline(
            y=float(target),
            line_dash="dash",
            line_color=FAIL_COLOR,
            annotation_text=target_label,
            annotation_position="top left",
        )
    return _layout(fig, title, "", yaxis, log_y=log_y)


def lines(x, ys: dict, *, title, xaxis, yaxis, log_x=False, log_y=False, dashed=(), vlines=(), hlines=()):
    """Several curves on shared axes; ``ys`` maps a legend name to y values (or to ``(x, y)``);
    names in ``dashed`` are drawn dashed (theory curves)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, y in ys.items():
        xx, yy = y if isinstance(y, tuple) else (x, y)
        fig.add_trace(
            go.Scatter(
                x=np.asarray(xx).tolist(),
                y=np.asarray(yy, dtype=float).tolist(),
                mode="lines",
                name=str(name),
                line=dict(dash="dash" if name in dashed else None),
            )
        )
    for v in vlines:
        fig.add_vline(x=float(v), line_dash="dot", line_color="grey")
    for v, label in hlines:
        fig.add_hline(y=float(v), line_dash="dash", line_color=FAIL_COLOR, annotation_text=label)
    return _layout(fig, title, xaxis, yaxis, log_x=log_x, log_y=log_y)


def thin(a, n=400):
    """Every k-th row of ``a`` so that at most ~n points are plotted (report size)."""
    a = np.asarray(a)
    k = max(1, len(a) // n)
    return a[::k]
