"""P4-T5's setting (papers.md): a small cluster and synthetic jobs, each with a known throughput model
theta_sys, a gradient noise scale phi_t that grows tenfold over training, and its work W in M0-equivalent
samples, arriving as a Poisson process; scheduled round by round by the allocation policies of
:mod:`elasticlab.alloc.policies`, each job a :class:`elasticlab.sim.SimJob` (the artifact's job model).

:class:`SyntheticApplication` stands where the simulator has a traced application
(:class:`elasticlab.sim.traces.Application`): the same attributes, computed from theta_sys and phi_t
instead of read from traces, so the step times the jobs run at are exactly the model the scheduler is given
(a "known theta_sys"). :func:`run_policy` is the simulator's round (60 s: advance the jobs, admit arrivals,
retire finished jobs, allocate, place, re-allocate changed jobs; ``elasticlab.sim.engine.simulate``), over
jobs it is given instead of jobs it builds from a workload's application names.
"""
from __future__ import annotations

import math

import numpy as np

from elasticlab.goodput import ThroughputModel

__all__ = ["SyntheticApplication", "synthetic_jobs", "run_policy", "small_cluster"]


class SyntheticApplication:
    """A job type with a known theta_sys; phi_t = phi0 * 10^(e/(E-1)) in epoch e of E; work W (samples at
    M0's efficiency) split evenly over the epochs. Pollux's gradient statistics are then sqr = 1 and
    var = phi_t / M0 (phi = M0 var / sqr), the same at every batch size."""

    def __init__(self, name: str, model: ThroughputModel, init_batch: int, phi0: float, work: float,
                 epochs: int = 10, max_batch_factor: int = 32, local_range=(8, 512)):
        self.name = name
        self.throughput_model = model
        self.init_batch_size = int(init_batch)
        self.max_batch_size = int(init_batch) * int(max_batch_factor)
        self.min_local_bsz, self.max_local_bsz = (int(x) for x in local_range)
        self.max_epochs = int(epochs)
        self.phi = phi0 * 10.0 ** (np.arange(epochs) / max(epochs - 1, 1))
        self.work = float(work)
        # progress is counted in M0-steps (the simulator's unit): W / M0 in all
        self._boundaries = np.linspace(0.0, self.work / self.init_batch_size, epochs + 1)

    @property
    def max_progress(self) -> float:
        return float(self._boundaries[-1])

    def progress_at(self, epoch: int) -> float:
        return float(self._boundaries[min(max(int(epoch), 0), self.max_epochs)])

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        e = min(max(int(epoch), 0), self.max_epochs - 1)
        return 1.0, float(self.phi[e] / self.init_batch_size)

    def grad_stats_table(self, batch_size: float):
        return np.ones(self.max_epochs), self.phi / self.init_batch_size

    def step_time(self, placement, local_bsz: float) -> tuple[float, float]:
        """(step, sync) with step - sync = T_grad, so an accumulation micro-step costs T_grad and a whole
        iteration costs theta_sys's T_iter exactly."""
        p = [int(x) for x in placement if x]
        if not p:
            raise ValueError("step_time of an empty placement")
        m = self.throughput_model
        step = float(m.step_time(len(p), sum(p), local_bsz))
        return step, step - float(m.grad_time(local_bsz))

    def batch_split(self, batch_size: float, replicas: int) -> tuple[int, int]:
        """Fixed global batch on ``replicas`` GPUs -> (per-GPU batch, accumulation steps), the traced
        applications' rule."""
        from elasticlab.sim.traces import Application

        return Application.batch_split(self, batch_size, replicas)

    def iteration_time(self, placement, atomic_bsz, accum_steps) -> float:
        step, sync = self.step_time(placement, atomic_bsz)
        return step + accum_steps * (step - sync)

    def __repr__(self):
        return f"SyntheticApplication({self.name!r}, M0={self.init_batch_size}, W={self.work:.3g})"


def _tuned(app: SyntheticApplication, rng, gpus_per_node: int) -> tuple[int, int]:
    """The user's "tuned" fixed configuration: a batch of 1, 2 or 4 M0 and the most GPUs (1..16, powers of
    two) whose scalability, throughput(k) / (k throughput(1)) at that batch, stays within a target drawn
    from [50%, 80%] (papers.md P4-T5 (b))."""
    batch = app.init_batch_size * int(rng.choice([1, 2, 4]))
    target = rng.uniform(0.5, 0.8)

    def thr(k):
        per, accum = app.batch_split(batch, k)
        place = [gpus_per_node] * (k // gpus_per_node) + ([k % gpus_per_node] if k % gpus_per_node else [])
        return per * k * (accum + 1) / app.iteration_time(place, per, accum)

    best, one = 1, thr(1)
    for k in (2, 4, 8, 16):
        if batch // k < app.min_local_bsz:
            break
        if thr(k) / (k * one) >= target:
            best = k
    return best, batch


def synthetic_jobs(n_jobs: int = 30, mean_interarrival: float = 240.0, median_gpu_hours: float = 1.0,
                   gpus_per_node: int = 4, seed: int = 0) -> list[dict]:
    """``n_jobs`` synthetic jobs with Poisson arrivals: each ``{"name", "time", "app", "num_replicas",
    "batch_size"}``. theta_sys drawn from ranges around the traced applications' fits (compute 20-100 ms +
    0.2-2 ms per example, sync within a node 5-30 ms + 1-10 ms per extra GPU, across nodes 20-100 ms +
    5-30 ms, overlap gamma 1-2.5); M0 in {64, 128, 256}; phi0 in [0.5, 4] M0; W such that the job takes a
    log-normal time (median ``median_gpu_hours``) on one GPU at M0."""
    rng = np.random.default_rng(seed)
    arrival = np.round(np.cumsum(rng.exponential(mean_interarrival, n_jobs)))
    arrival -= arrival[0]
    jobs = []
    for i in range(n_jobs):
        model = ThroughputModel(alpha_grad=rng.uniform(0.02, 0.1), beta_grad=rng.uniform(2e-4, 2e-3),
                                alpha_local=rng.uniform(0.005, 0.03), beta_local=rng.uniform(1e-3, 1e-2),
                                alpha_node=rng.uniform(0.02, 0.1), beta_node=rng.uniform(5e-3, 3e-2),
                                gamma=rng.uniform(1.0, 2.5))
        m0 = int(rng.choice([64, 128, 256]))
        hours = median_gpu_hours * math.exp(rng.normal(0.0, 0.7))
        samples_per_s = m0 / float(model.iter_time(1, 1, m0))
        app = SyntheticApplication(f"synthetic-{i}", model, m0, phi0=m0 * rng.uniform(0.5, 4.0),
                                   work=samples_per_s * hours * 3600.0)
        k, batch = _tuned(app, rng, gpus_per_node)
        jobs.append({"name": f"job-{i}", "time": float(arrival[i]), "app": app, "num_replicas": k,
                     "batch_size": batch})
    return jobs


def run_policy(jobs: list[dict], policy: str, cluster: str = "4x4", interval: float = 60.0,
               restart_delay: float = 30.0, max_time: float = 30 * 24 * 3600.0) -> dict:
    """Schedule ``jobs`` under ``policy`` round by round; ``{"jct": [...], "avg_jct", "makespan",
    "restarts"}`` (JCT = completion - submission, seconds)."""
    from elasticlab.alloc.placement import place
    from elasticlab.alloc.policies import Cluster, get_policy
    from elasticlab.sim import SimJob

    pol, cl = get_policy(policy), Cluster.parse(cluster)
    pending = sorted(jobs, key=lambda j: j["time"])
    live: list[SimJob] = []
    done: list[SimJob] = []
    placements: dict = {}
    t = 0.0
    while (pending or live) and t < max_time:
        for j in live:
            j.step(interval)
        t += interval
        while pending and pending[0]["time"] <= t:
            spec = pending.pop(0)
            j = SimJob(spec["name"], spec["app"], spec["time"], spec["num_replicas"], spec["batch_size"],
                       pol.batch_mode, restart_delay)
            j.current_time = t  # it waited, unplaced, until this round
            live.append(j)
        for j in [j for j in live if j.done]:
            if j.placement:
                j.reallocate(())
            placements.pop(j.name, None)
            done.append(j)
        live = [j for j in live if not j.done]
        if not live:
            continue
        counts = pol.allocate(live, t, cl)
        new = place(counts, placements, cl.num_nodes, cl.gpus_per_node,
                    one_distributed_per_node=pol.one_distributed_per_node, elastic=not pol.gang,
                    order=pol.placement_order(live), node_sizes=cl.node_sizes)
        for j in live:
            if tuple(placements.get(j.name, ())) != tuple(new.get(j.name, ())):
                j.reallocate(new.get(j.name, ()))
        placements = new
    if live or pending:
        raise RuntimeError(f"{policy}: {len(live) + len(pending)} jobs unfinished after {max_time:g} s")
    jct = np.array([j.completion_time - j.submission_time for j in done])
    return {"avg_jct": float(jct.mean()), "p99_jct": float(np.percentile(jct, 99)),
            "makespan": float(max(j.completion_time for j in done) - min(j.submission_time for j in done)),
            "restarts": int(sum(j.restarts for j in done)), "jct": jct.tolist()}


def small_cluster(n_jobs: int = 30, cluster: str = "4x4", policies=None, seed: int = 0, **kw) -> dict:
    """P4-T5: the same synthetic jobs under each policy (default: Pollux's comparison,
    :data:`elasticlab.sim.experiments.ARTIFACT_POLICIES`)."""
    from elasticlab.sim.experiments import ARTIFACT_POLICIES

    policies = ARTIFACT_POLICIES if policies is None else policies
    jobs = synthetic_jobs(n_jobs, seed=seed, **kw)
    out = {pol: run_policy(jobs, pol, cluster) for pol in policies}
    configs = [(j["num_replicas"], j["batch_size"] // j["app"].init_batch_size) for j in jobs]
    return {"n_jobs": n_jobs, "cluster": cluster, "policies": out,
            "tuned_gpus": [c[0] for c in configs], "tuned_batch_x_m0": [c[1] for c in configs]}
