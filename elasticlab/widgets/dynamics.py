"""``DynamicsExplorer``: train a small linear or ReLU net on Saxe's whitened teacher; watch its layers grow.

Controls: depth, width, init scale, learning rate, biases on/off, activation (linear/ReLU), start (Saxe's
balanced aligned start or small random weights) and the horizon in units of τ = 1/η. Two plotly charts:
the growth ‖W_j(t)‖²_F − ‖W_j(0)‖²_F of every layer (dotted: with the layer's bias counted, the quantity
that theory/02 Eq. (2.4) balances), and the mode strengths u_α(t) of the net's linear part against Saxe's
closed form (theory/01 Eq. (1.8)-(1.10)). Every control change retrains (numba, well under a second) and
redraws.
"""
from __future__ import annotations

import numpy as np

from elasticlab import dynamics as D

__all__ = ["DynamicsExplorer"]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
_MAX_STEPS = 200_000


def _fig(title, xaxis, yaxis):
    import plotly.graph_objects as go

    fig = go.FigureWidget()
    fig.update_layout(title={"text": title, "x": 0.02, "font": {"size": 13}}, height=300,
                      margin={"l": 55, "r": 15, "t": 40, "b": 40}, xaxis_title=xaxis, yaxis_title=yaxis,
                      template="plotly_white", legend={"font": {"size": 10}})
    return fig


def linear_part(net, X, params) -> np.ndarray:
    """Least-squares linear map of the net's outputs on whitened inputs: f(X)ᵀX/n (= W_e for a linear
    bias-free net; Σ11 = I)."""
    return net.forward(X, params).T @ X / X.shape[0]


class DynamicsExplorer:
    """Interactive view of layer growth and Saxe mode curves (ipywidgets + plotly FigureWidget).

    ``DynamicsExplorer(s=(5, 3, 2, 1, 0.5))`` builds the controls, trains once and draws; display it in a
    notebook cell (or display ``.widget``). ``.trajectory`` holds the last run, ``.summary`` its numbers.
    """

    def __init__(self, s=(5.0, 3.0, 2.0, 1.0, 0.5), d: int | None = None, depth: int = 2, width: int = 8,
                 init_scale: float = 1e-2, lr: float = 2e-3, biases: bool = False, activation: str = "linear",
                 start: str = "aligned", horizon: float = 12.0, records: int = 300, seed: int = 0):
        import ipywidgets as W

        s = np.asarray(s, dtype=np.float64)
        d = int(d or s.size)
        self.task = D.saxe_task(s, d_in=d, seed=seed, symmetric=True)
        self.records = int(records)
        self.seed = int(seed)
        m = self.task.U.shape[1]
        if activation not in ("linear", "relu"):
            raise ValueError(f"activation must be 'linear' or 'relu', got {activation!r}")
        if start not in ("aligned", "random"):
            raise ValueError(f"start must be 'aligned' or 'random', got {start!r}")
        style = {"description_width": "90px"}
        lay = W.Layout(width="330px")
        self.controls = {
            "depth": W.IntSlider(value=depth, min=1, max=6, description="depth N", continuous_update=False,
                                 style=style, layout=lay),
            "width": W.IntSlider(value=max(width, m), min=m, max=64, description="width",
                                 continuous_update=False, style=style, layout=lay),
            "init_scale": W.FloatLogSlider(value=init_scale, base=10, min=-4, max=0, step=0.25,
                                           description="init scale", continuous_update=False, style=style,
                                           layout=lay, readout_format=".1e"),
            "lr": W.FloatLogSlider(value=lr, base=10, min=-4, max=-0.5, step=0.25, description="LR η",
                                   continuous_update=False, style=style, layout=lay, readout_format=".1e"),
            "horizon": W.FloatSlider(value=horizon, min=1, max=60, step=1, description="time (τ)",
                                     continuous_update=False, style=style, layout=lay),
            "biases": W.Checkbox(value=biases, description="biases"),
            "activation": W.ToggleButtons(options=["linear", "relu"], value=activation,
                                          description="activation", style=style),
            "start": W.ToggleButtons(options=["aligned", "random"], value=start, description="start",
                                     style=style),
        }
        self.norm_fig = _fig("layer growth ‖W_j(t)‖² − ‖W_j(0)‖²", "t / τ", "growth")
        self.mode_fig = _fig("modes u_α(t): GD (solid) vs Saxe (dashed)", "t / τ", "u_α")
        self.status = W.HTML()
        for c in self.controls.values():
            c.observe(self._on_change, names="value")
        left = W.VBox(list(self.controls.values()) + [self.status])
        self.widget = W.HBox([left, W.VBox([self.norm_fig, self.mode_fig])])
        self.trajectory = None
        self.summary = {}
        self.update()

    # ---- model ---------------------------------------------------------------------------------------
    @property
    def params(self) -> dict:
        return {k: c.value for k, c in self.controls.items()}

    def _net(self, p):
        d = self.task.V.shape[0]
        depth, width = int(p["depth"]), int(p["width"])
        slope = 1.0 if p["activation"] == "linear" else 0.0
        widths = [d] + [width] * (depth - 1) + [self.task.U.shape[0]]
        if p["start"] == "aligned":
            lin = D.aligned_init(self.task.U, self.task.V, float(p["init_scale"]) ** depth, depth, width,
                                 seed=self.seed)
            net = D.MLP(widths, slope=slope, has_bias=bool(p["biases"]))
            for w, w0 in zip(net.weights, lin.weights):
                w[...] = w0
            return net, float(p["init_scale"]) ** depth
        net = D.random_init(widths, float(p["init_scale"]), slope=slope, biases=bool(p["biases"]),
                            seed=self.seed)
        return net, None

    def run(self):
        """Train with the current controls; returns the :class:`~elasticlab.dynamics.Trajectory`."""
        p = self.params
        net, u0 = self._net(p)
        lr = float(p["lr"])
        steps = int(min(_MAX_STEPS, max(10, round(float(p["horizon"]) / lr))))
        tr = D.train(net, self.task.X, self.task.Y, lr, steps, record_points=self.records)
        return tr, u0

    # ---- view ----------------------------------------------------------------------------------------
    def update(self):
        with np.errstate(over="ignore", invalid="ignore"):
            self._update()

    def _update(self):
        tr, u0 = self.run()
        self.trajectory = tr
        if len(tr.steps) < 2:
            self.norm_fig.data = []
            self.mode_fig.data = []
            self.summary = {"steps": 0, "diverged": True}
            self.status.value = ("<b style='color:#d62728'>diverged at once: lower the LR or the init "
                                 "scale</b>")
            return
        t = tr.time
        norms = tr.weight_norms
        growth = norms - norms[0]
        s = self.task.s
        nz = np.flatnonzero(s > 0)
        lin = np.stack([linear_part(tr.net, self.task.X, q) for q in tr.params])
        u = D.mode_strengths(lin, self.task.U, self.task.V)
        depth = tr.net.depth
        u_start = u0 if u0 is not None else np.maximum(np.abs(u[0]), 1e-12)
        saxe = D.mode_curves(t, s[nz], np.broadcast_to(u_start, s.shape)[nz], depth=depth)
        with self.norm_fig.batch_update():
            self.norm_fig.data = []
            for j in range(depth):
                self.norm_fig.add_scatter(x=t, y=growth[:, j], mode="lines", name=f"W{j + 1}",
                                          line={"color": _COLORS[j % len(_COLORS)]})
            if tr.net.has_bias:
                bn = tr.bias_norms
                with_b = norms + bn - (norms[0] + bn[0])
                for j in range(depth - 1):
                    self.norm_fig.add_scatter(x=t, y=with_b[:, j], mode="lines", name=f"W{j + 1}+b{j + 1}",
                                              line={"color": _COLORS[j % len(_COLORS)], "dash": "dot"})
        with self.mode_fig.batch_update():
            self.mode_fig.data = []
            for k, a in enumerate(nz):
                c = _COLORS[k % len(_COLORS)]
                self.mode_fig.add_scatter(x=t, y=u[:, a], mode="lines", name=f"s={s[a]:g}", line={"color": c})
                self.mode_fig.add_scatter(x=t, y=saxe[:, k], mode="lines", name=f"Saxe s={s[a]:g}",
                                          line={"color": c, "dash": "dash"}, showlegend=False)
        g = growth[-1]
        spread = float((g.max() - g.min()) / max(abs(g.mean()), 1e-300)) if depth > 1 else 0.0
        drift = float(D.invariant_drift(tr).max()) if depth > 1 else 0.0
        err = float(np.max(np.abs(u[:, nz] - saxe)) / s[nz].max())
        self.summary = {"steps": int(tr.steps[-1]), "diverged": bool(tr.diverged), "loss": float(tr.loss[-1]),
                        "growth": [float(v) for v in g], "growth_spread": spread, "invariant_drift": drift,
                        "saxe_max_error": err}
        warn = "<b style='color:#d62728'>diverged: lower the LR</b> · " if tr.diverged else ""
        if not tr.diverged and tr.loss[-1] > 0.99 * tr.loss[0]:
            warn = ("<b>still on the plateau</b> (deep nets from small weights wait ~u0^{−(N−2)/N}): "
                    "raise the init scale or the time · ")
        self.status.value = (f"<small>{warn}{self.summary['steps']} steps · loss {tr.loss[-1]:.3g}<br>"
                             f"growth spread {spread:.2%} · invariant drift {drift:.1e}<br>"
                             f"max |u − Saxe| / s_max {err:.1%}</small>")

    def _on_change(self, _change):
        self.update()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
