"""AllocationExplorer: how a cluster's GPUs are split across jobs, by the exact DP and by the baselines.

Each job is one of the Pollux artifact's applications (:mod:`elasticlab.sim.traces`) with its fitted
throughput model and gradient statistics, so its speedup at g GPUs is Pollux Eq. (8) (best batch per g).
The DP (:func:`elasticlab.alloc.dp_allocate`, Saxena et al. 2020) maximises Pollux's fitness, the power
mean of the speedups with fairness power p (Pollux Eq. (9)); the baselines are the scheduling policies of
:mod:`elasticlab.alloc.policies` marked ``baseline``, asked for one round on the same jobs. Sliders set
the capacity and p.
"""
from __future__ import annotations

import html

import ipywidgets as W
import numpy as np

from elasticlab.checks import number, whole
from elasticlab.widgets._common import LiveFigure, Panel, color, html_table, subplots_figure


def default_jobs() -> tuple[str, ...]:
    """The jobs shown by default: one per application of the Pollux artifact
    (:data:`elasticlab.sim.traces.APPLICATIONS`)."""
    from elasticlab.sim.traces import APPLICATIONS

    return tuple(APPLICATIONS)


def baseline_policies() -> tuple[str, ...]:
    """The policies compared with the DP: those of :data:`elasticlab.alloc.policies.POLICIES` marked
    ``baseline``, in the registry's order."""
    from elasticlab.alloc.policies import POLICIES

    return tuple(name for name, cls in POLICIES.items() if cls.baseline)


def __getattr__(name):  # ``DEFAULT_JOBS`` and ``BASELINES``, read from the registries when asked
    if name == "DEFAULT_JOBS":
        return default_jobs()
    if name == "BASELINES":
        return baseline_policies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fitness_utility(speedup: np.ndarray, p: float) -> np.ndarray:
    """Per-job utility whose sum is a monotone transform of the power mean (Pollux Eq. (9)).

    p > 0: s^p; p = 0: log s; p < 0: -s^p. Zero GPUs (s = 0) is infeasible for p <= 0 (the power mean is
    0 as soon as one job gets nothing), so every job must get a GPU then."""
    s = np.asarray(speedup, dtype=float)
    with np.errstate(divide="ignore"):
        if p > 0:
            return s ** p
        if p == 0:
            return np.where(s > 0, np.log(np.where(s > 0, s, 1.0)), -np.inf)
        return np.where(s > 0, -np.power(np.where(s > 0, s, 1.0), p), -np.inf)


def job_table(apps=None, workload: str = "workload-6"):
    """One row per job (name, time, application, num_replicas, batch_size): each application's requested
    GPUs and batch are those of its first job in the artifact's ``workload``. ``apps``: application names
    (default :func:`default_jobs`)."""
    import pandas as pd

    from elasticlab.sim import load_workload

    apps = default_jobs() if apps is None else apps
    wl = load_workload(workload)
    rows = []
    for i, app in enumerate(apps):
        first = wl[wl.application == app]
        if not len(first):
            raise ValueError(f"application {app!r} does not occur in {workload}")
        r = first.iloc[0]
        rows.append({"name": f"{app}-{i}", "time": 0, "application": app,
                     "num_replicas": int(r.num_replicas), "batch_size": int(r.batch_size)})
    return pd.DataFrame(rows)


def make_jobs(table, policy="pollux"):
    """Simulator jobs for ``table`` as ``policy`` would run them, treated as already profiled (so their
    fitted throughput models, not a linear guess, give the speedups)."""
    from elasticlab.alloc.policies import get_policy
    from elasticlab.sim import make_jobs as sim_jobs

    pol = get_policy(policy) if isinstance(policy, str) else policy
    jobs = sim_jobs(table, pol)
    for j in jobs:
        j.max_profiled_replicas = 10**6
    return jobs


def allocate(table, capacity: int, p: float = -1.0, gpus_per_node: int = 4, baselines=None) -> dict:
    """Allocations {method: {job name: GPUs}} and their totals, for the DP and each baseline policy
    (``baselines``: policy names, default :func:`baseline_policies`).

    ``table``: jobs as from :func:`job_table`. Totals per method: ``goodput`` (sum of predicted goodputs,
    in base-batch steps/s, each job at its best batch for its GPUs), ``throughput`` (the same at
    statistical efficiency 1), ``speedup`` and ``throughput_speedup`` (the same per job divided by its 1-GPU
    value, Pollux Eq. (8), then summed: comparable across jobs whose step rates differ by orders of
    magnitude), ``fitness`` (Pollux Eq. (9) at this p) and ``gpus`` used."""
    from elasticlab.alloc import dp_allocate
    from elasticlab.alloc.objective import fitness
    from elasticlab.alloc.policies import Cluster, get_policy

    capacity, p = int(capacity), float(p)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 GPU, got {capacity!r}")
    if not len(table):
        raise ValueError("no jobs to allocate")
    if p <= 0 and capacity < len(table):
        raise ValueError(f"with fairness power p={p} every job needs a GPU: capacity {capacity} < "
                         f"{len(table)} jobs")
    jobs = make_jobs(table, "pollux")
    names = [j.name for j in jobs]
    good = np.stack([j.goodput_curve(capacity, gpus_per_node) for j in jobs])
    thr = np.stack([j.goodput_curve(capacity, gpus_per_node, mode="throughput") for j in jobs])
    speed = np.stack([j.speedup_curve(capacity, gpus_per_node) for j in jobs])
    thr_speed = np.stack([j.speedup_curve(capacity, gpus_per_node, mode="throughput") for j in jobs])
    out = {"dp": dict(zip(names, dp_allocate(fitness_utility(speed, p), capacity).tolist()))}
    # exactly `capacity` GPUs: whole nodes and, when capacity is not a multiple of the node size, a part
    cluster = Cluster.of_capacity(capacity, gpus_per_node)
    for name in baseline_policies() if baselines is None else baselines:
        try:
            pol = get_policy(name)
            counts = pol.allocate(make_jobs(table, pol), 0.0, cluster)
        except Exception as e:  # a baseline that needs simulator state it does not have here
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out[name] = {n: int(counts.get(n, 0)) for n in names}
    totals = {}
    idx = np.arange(len(jobs))
    for method, alloc in out.items():
        if "error" in alloc:
            continue
        g = np.array([alloc[n] for n in names])
        s = speed[idx, g]
        totals[method] = {"gpus": int(g.sum()), "goodput": float(good[idx, g].sum()),
                          "throughput": float(thr[idx, g].sum()), "speedup": float(s.sum()),
                          "throughput_speedup": float(thr_speed[idx, g].sum()),
                          "fitness": float(fitness(s, p)) if p > 0 or np.all(s > 0) else 0.0}
    return {"jobs": names, "allocations": out, "totals": totals, "speedup": speed}


class AllocationExplorer(Panel):
    """Bars of GPUs per job under the DP and the baselines, with goodput/throughput totals.

    ``jobs``: application names (default: the six of the Pollux artifact). ``capacity``: the cluster's GPUs
    (slider up to ``max_capacity``). ``p``: Pollux's fairness power (slider from -3 to 1).
    """

    def __init__(self, jobs=None, capacity: int = 16, p: float = -1.0, gpus_per_node: int = 4,
                 max_capacity: int = 64, baselines=None):
        from elasticlab.alloc.policies import POLICIES

        jobs = default_jobs() if jobs is None else jobs
        capacity, max_capacity = whole("capacity", capacity, 1), whole("max_capacity", max_capacity, 1)
        p = number("p", p, lambda v: -3.0 <= v <= 1.0, "a fairness power in [-3, 1] (the slider's range)")
        unknown = [b for b in baselines or () if b not in POLICIES]
        if unknown:
            raise ValueError(f"unknown baseline policies {unknown}; choose from {sorted(POLICIES)}")
        if max_capacity < len(jobs):
            raise ValueError(f"max_capacity {max_capacity!r} is below the number of jobs {len(jobs)}")
        if not len(jobs) <= capacity <= max_capacity:
            raise ValueError(f"capacity must be in [{len(jobs)}, {max_capacity}], got {capacity!r}")
        self.table = job_table(jobs)
        self.jobs = make_jobs(self.table)
        self.gpus_per_node = int(gpus_per_node)
        self.baselines = baseline_policies() if baselines is None else tuple(baselines)
        self.capacity = W.IntSlider(value=capacity, min=len(self.jobs), max=max_capacity,
                                    description="GPUs", continuous_update=False)
        self.capacity.add_class("elasticlab-capacity")
        self.p = W.FloatSlider(value=p, min=-3.0, max=1.0, step=0.25, description="fairness p",
                               continuous_update=False)
        self.p.add_class("elasticlab-fairness")
        self.totals = W.HTML()
        self.totals.add_class("elasticlab-alloc-totals")
        self.message = W.HTML()
        methods = ["dp", *self.baselines]
        fig = subplots_figure(["GPUs per job", "Sum of speedups (goodput, throughput)"], rows=1, cols=2,
                              height=420,
                              column_widths=[0.65, 0.35])
        for i, m in enumerate(methods):
            fig.add_bar(x=[j.name for j in self.jobs], y=[0] * len(self.jobs), name=m, marker_color=color(i),
                        row=1, col=1)
        fig.add_bar(x=methods, y=[0] * len(methods), name="goodput speedup", marker_color="#444444",
                    row=1, col=2)
        fig.add_bar(x=methods, y=[0] * len(methods), name="throughput speedup", marker_color="#bbbbbb",
                    row=1, col=2)
        fig.update_layout(barmode="group", showlegend=True, margin={"t": 75},
                          legend={"orientation": "h", "x": 0, "y": 1.1, "yanchor": "bottom"})
        # job names in full on a narrow page: tilted, and the margin grows to hold them
        fig.update_xaxes(tickangle=-30, automargin=True, title_text="job", row=1, col=1)
        fig.update_xaxes(tickangle=-30, automargin=True, title_text="method", row=1, col=2)
        fig.update_yaxes(title_text="GPUs", row=1, col=1)
        fig.update_yaxes(title_text="Σ_j speedup over 1 GPU", row=1, col=2)
        self.chart = LiveFigure(fig)
        self.figure = self.chart.figure
        self.result: dict | None = None
        self.capacity.observe(lambda _: self.update(), names="value")
        self.p.observe(lambda _: self.update(), names="value")
        self.widget = W.VBox([W.HTML("<b>elasticlab · allocation explorer</b>"),
                              W.HBox([self.capacity, self.p]), self.chart.widget, self.totals, self.message])
        self.widget.add_class("elasticlab-allocation-explorer")
        self.update()

    def update(self) -> dict:
        """Recompute all allocations for the current sliders and redraw."""
        res = allocate(self.table, self.capacity.value, self.p.value, self.gpus_per_node, self.baselines)
        self.result = res
        methods = ["dp", *self.baselines]
        fig = self.figure
        with fig.batch_update():
            for i, m in enumerate(methods):
                alloc = res["allocations"].get(m, {})
                fig.data[i].y = [alloc.get(j.name, 0) if "error" not in alloc else 0 for j in self.jobs]
            tot = res["totals"]
            fig.data[len(methods)].y = [tot.get(m, {}).get("speedup", 0.0) for m in methods]
            fig.data[len(methods) + 1].y = [tot.get(m, {}).get("throughput_speedup", 0.0) for m in methods]
            fig.layout.annotations[0].text = (f"GPUs per job ({self.capacity.value} GPUs, "
                                              f"p = {self.p.value:g})")
        self.chart.show()
        rows = [{"method": m, **res["totals"][m]} for m in methods if m in res["totals"]]
        self.totals.value = html_table(rows, ["method", "gpus", "speedup", "throughput_speedup", "fitness",
                                              "goodput", "throughput"])
        errs = [f"{m}: {html.escape(a['error'])}" for m, a in res["allocations"].items() if "error" in a]
        self.message.value = ("<small style='color:#a00'>" + "<br>".join(errs) + "</small>") if errs else ""
        return res



__all__ = ["AllocationExplorer", "allocate", "fitness_utility", "job_table", "make_jobs"]
