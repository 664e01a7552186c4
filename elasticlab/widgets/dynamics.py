"""``DynamicsExplorer``: train a small linear or ReLU net on Saxe's whitened teacher; watch its layers grow.

Controls: depth, width, init scale, learning rate, biases on/off, activation (linear/ReLU), start (Saxe's
balanced aligned start or small random weights) and the horizon in units of τ = 1/η. Three plotly charts:
the growth ‖W_j(t)‖²_F − ‖W_j(0)‖²_F of every layer (dotted: with the layer's bias counted, the quantity
that theory/02 Eq. (2.4) balances), the relative growth rate d ln‖W_j‖²/dt of every layer with the detected
phases shaded (plateau, burst, saturation; theory/03 §3.3) and the plateau's end against the theory, and the
mode strengths u_α(t) of the net's linear part against Saxe's closed form (theory/01 Eq. (1.8)-(1.10)). A
table gives each layer's mean relative rate and growth per phase. Every control change retrains (numba, well
under a second) and redraws.
"""
from __future__ import annotations

import numpy as np

from elasticlab import dynamics as D
from elasticlab.checks import number, whole
from elasticlab.widgets._common import Panel, color

__all__ = ["DynamicsExplorer"]

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


class DynamicsExplorer(Panel):
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
        # The sliders' ranges: a value outside one would be clamped to it without a word.
        for name, value, lo, hi in (("init_scale", init_scale, 1e-4, 1.0), ("lr", lr, 1e-4, 10 ** -0.5),
                                    ("horizon", horizon, 1.0, 60.0)):
            number(name, value, lambda v, lo=lo, hi=hi: lo <= v <= hi, f"in [{lo:g}, {hi:g}]")
        whole("depth", depth, 1, most=6)
        whole("width", width, 1, most=64)
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
        self.rate_fig = _fig("relative growth d ln‖W_j‖²/dt by phase (dotted: plateau end, theory dashed)",
                             "t / τ", "d ln‖W_j‖² / dt")
        self.status = W.HTML()
        self.phase_table = W.HTML()
        for c in self.controls.values():
            c.observe(self._on_change, names="value")
        left = W.VBox(list(self.controls.values()) + [self.status, self.phase_table])
        self.widget = W.HBox([left, W.VBox([self.norm_fig, self.rate_fig, self.mode_fig])])
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
            self.rate_fig.data = []
            self.phase_table.value = ""
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
                                          line={"color": color(j)})
            if tr.net.has_bias:
                bn = tr.bias_norms
                with_b = norms + bn - (norms[0] + bn[0])
                for j in range(depth - 1):
                    self.norm_fig.add_scatter(x=t, y=with_b[:, j], mode="lines", name=f"W{j + 1}+b{j + 1}",
                                              line={"color": color(j), "dash": "dot"})
        with self.mode_fig.batch_update():
            self.mode_fig.data = []
            for k, a in enumerate(nz):
                c = color(k)
                self.mode_fig.add_scatter(x=t, y=u[:, a], mode="lines", name=f"s={s[a]:g}", line={"color": c})
                self.mode_fig.add_scatter(x=t, y=saxe[:, k], mode="lines", name=f"Saxe s={s[a]:g}",
                                          line={"color": c, "dash": "dash"}, showlegend=False)
        phases, t_pl, t_th = self._draw_rates(tr, s[nz].max(), u_start if u0 is not None
                                              else float(np.abs(u[0, nz[np.argmax(s[nz])]])))
        g = growth[-1]
        spread = float((g.max() - g.min()) / max(abs(g.mean()), 1e-300)) if depth > 1 else 0.0
        drift = float(D.invariant_drift(tr).max()) if depth > 1 else 0.0
        err = float(np.max(np.abs(u[:, nz] - saxe)) / s[nz].max())
        self.summary = {"steps": int(tr.steps[-1]), "diverged": bool(tr.diverged), "loss": float(tr.loss[-1]),
                        "growth": [float(v) for v in g], "growth_spread": spread, "invariant_drift": drift,
                        "saxe_max_error": err, "phases": phases, "plateau_end": t_pl,
                        "first_burst": self._first_burst, "plateau_end_theory": t_th}
        warn = "<b style='color:#d62728'>diverged: lower the LR</b> · " if tr.diverged else ""
        if not tr.diverged and tr.loss[-1] > 0.99 * tr.loss[0]:
            warn = ("<b>still on the plateau</b> (deep nets from small weights wait ~u0^{−(N−2)/N}): "
                    "raise the init scale or the time · ")
        self.status.value = (f"<small>{warn}{self.summary['steps']} steps · loss {tr.loss[-1]:.3g}<br>"
                             f"growth spread {spread:.2%} · invariant drift {drift:.1e}<br>"
                             f"max |u − Saxe| / s_max {err:.1%}</small>")

    def _draw_rates(self, tr, s_max, u0):
        """Per-layer d ln‖W_j‖²/dt with the phases of ‖W_1‖² shaded; per-phase table (theory/03 §3.3).
        Returns (per-phase numbers, detected plateau end, theory's first-burst midpoint), times in τ."""
        from elasticlab.dynamics import growth as GR

        tm, rates = GR.log_rates(tr)
        depth = tr.net.depth
        self._first_burst = None
        try:
            iv = GR.phase_intervals(tr.time, tr.weight_norms[:, 0])
            pg = GR.phase_growth(tr, iv)
            self._first_burst = D.detect_phases(tr.time, tr.weight_norms[:, 0]).bursts[0].t_peak
        except (ValueError, IndexError):
            iv, pg = {}, {}
        t_th = None
        if 0 < u0 < s_max:
            t_th = D.plateau_time(s_max, u0) if depth == 2 else D.half_time(s_max, u0, depth)
        shade = {"plateau": "#9e9e9e", "burst": "#ff7f0e", "saturation": "#2ca02c"}
        with self.rate_fig.batch_update():
            self.rate_fig.data = []
            for j in range(depth):
                self.rate_fig.add_scatter(x=tm, y=rates[:, j], mode="lines", name=f"W{j + 1}",
                                          line={"color": color(j)})
            shapes = [{"type": "rect", "xref": "x", "yref": "paper", "x0": a, "x1": b, "y0": 0, "y1": 1,
                       "fillcolor": shade[name], "opacity": 0.10, "line": {"width": 0}}
                      for name, (a, b) in iv.items()]
            vl = lambda x, dash, c: {"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x,  # noqa: E731
                                     "y0": 0, "y1": 1, "line": {"dash": dash, "color": c, "width": 1}}
            if "plateau" in iv:
                shapes.append(vl(iv["plateau"][1], "dot", "#444"))
            if t_th is not None and t_th <= tr.time[-1]:
                shapes.append(vl(t_th, "dash", "#d62728"))
            self.rate_fig.layout.shapes = shapes
        out = {k: {"t_start": v["t_start"], "t_end": v["t_end"],
                   "mean_log_rate": [float(x) for x in v["mean_log_rate"]],
                   "growth": [float(x) for x in v["growth"]]} for k, v in pg.items()}
        rows = "".join(f"<tr><td>{k}</td><td>{v['t_start']:.2g}–{v['t_end']:.2g}</td><td>"
                       + " / ".join(f"{x:.3g}" for x in v["mean_log_rate"]) + "</td><td>"
                       + " / ".join(f"{x:.3g}" for x in v["growth"]) + "</td></tr>" for k, v in out.items())
        th = f"theory (first burst midpoint) {t_th:.3g}τ" if t_th is not None else "theory: n/a (u0 ≥ s)"
        fb = f"{self._first_burst:.3g}τ" if self._first_burst is not None else "none"
        self.phase_table.value = (
            "<small><table><tr><th>phase</th><th>t/τ</th><th>mean d ln‖W_j‖²/dt</th><th>growth</th></tr>"
            f"{rows}</table>first burst at {fb} · {th}</small>")
        return out, (iv["plateau"][1] if "plateau" in iv else None), t_th

    def _on_change(self, _change):
        self.update()

