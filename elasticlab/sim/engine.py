"""The trace-replay cluster simulator (after the Pollux artifact's simulator, pollux-artifact.md §5).

Every ``interval`` seconds (60): advance every submitted job (``SimJob.step``), ask the policy for GPU
counts of the active jobs, place them on ``num_nodes`` x ``gpus_per_node`` GPUs, and re-allocate the jobs
whose placement changed (each change costs the job ``restart_delay`` = 30 s). Ends when every job is done
(or at ``max_time``). Under batch-adaptive policies NCF jobs keep the user's configuration (1 GPU, batch
32768), as in the artifact.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd

from elasticlab.alloc.placement import place
from elasticlab.alloc.policies import Cluster, Policy, get_policy
from elasticlab.sim.job import SimJob
from elasticlab.sim.metrics import SimResult, summarize
from elasticlab.sim.traces import load_application
from elasticlab.sim.workload import check_limit, check_workload, load_workload

__all__ = ["simulate", "make_jobs", "MAX_IDLE_ROUNDS"]

#: The most scheduling rounds before the last submission (each round costs a little even when idle): a
#: workload whose last job arrives later than this many intervals is refused up front instead of running
#: for hours (1e6 rounds = 694 days at the default 60 s).
MAX_IDLE_ROUNDS = 1_000_000


def _number(name, value, ok, need):
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be {need}, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(x) or not ok(x):
        raise ValueError(f"{name} must be {need}, got {value!r}")
    return x


def make_jobs(workload: pd.DataFrame, policy: Policy, restart_delay: float = 30.0) -> list[SimJob]:
    jobs = []
    for row in workload.itertuples(index=False):
        app = load_application(row.application)
        mode = policy.batch_mode
        pin = row.application == "ncf" and mode != "fixed"
        if pin:
            mode = "fixed"  # the artifact pins NCF to its user config (1 GPU, batch 32768) under Pollux
        job = SimJob(row.name, app, row.time, int(row.num_replicas), int(row.batch_size), mode, restart_delay)
        if pin:
            job.gpu_limit = int(row.num_replicas)
        jobs.append(job)
    return jobs


def simulate(workload, policy="pollux", cluster: Cluster | str = "16x4", interval: float = 60.0,
             restart_delay: float = 30.0, limit: int | None = None, max_time: float | None = None,
             progress: bool = True, policy_kwargs: dict | None = None) -> SimResult:
    """Replay ``workload`` (a DataFrame, CSV path or shared name like 'workload-6') under ``policy``."""
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    interval = _number("interval", interval, lambda x: x > 0, "a finite number of seconds > 0")
    restart_delay = _number("restart_delay", restart_delay, lambda x: x >= 0,
                            "a finite number of seconds >= 0")
    if max_time is not None:
        max_time = _number("max_time", max_time, lambda x: x > 0, "a finite number of seconds > 0")
    limit = check_limit(limit)
    name = str(workload) if not isinstance(workload, pd.DataFrame) else "dataframe"
    if isinstance(workload, pd.DataFrame):
        df = check_workload(workload, "workload (DataFrame)")
        if limit is not None:
            df = df.head(limit)
    else:
        df = load_workload(workload, limit=limit)
    last = float(df.time.max())
    if max_time is None and last / interval > MAX_IDLE_ROUNDS:
        job = df.name.iloc[int(np.argmax(df.time.to_numpy(float)))]
        raise ValueError(f"job {job!r} is submitted at time {last:g} s, {last / interval:.3g} "
                         f"scheduling rounds of {interval:g} s after the start; a workload may span at most "
                         f"{MAX_IDLE_ROUNDS:.0e} rounds before its last submission (check its time column, "
                         f"or pass max_time to cut the run)")
    pol = get_policy(policy, **(policy_kwargs or {})) if isinstance(policy, str) else policy
    jobs = make_jobs(df, pol, restart_delay)
    for j in jobs:
        _ = j.app.throughput_model  # fit once up front (cached per application)
    placements: dict = {}
    t = 0.0
    util_rows = []
    sched = []
    contention = {j.name: [] for j in jobs}
    horizon = max_time if max_time is not None else float("inf")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc=f"simulate {pol.name}", unit="job", leave=False)
    n_done = 0
    while t < horizon:
        for j in jobs:
            j.step(interval)
        t += interval
        active = [j for j in jobs if j.submission_time <= t and not j.done]
        finished = sum(j.done for j in jobs)
        if bar is not None and finished > n_done:
            bar.update(finished - n_done)
        n_done = finished
        for j in jobs:  # free the GPUs of finished jobs
            if j.done and j.placement:
                j.reallocate(())
                placements.pop(j.name, None)
        if n_done == len(jobs):
            break
        t0 = time.process_time()  # CPU seconds: robust to other load on the machine
        counts = pol.allocate(active, t, cluster) if active else {}
        new = place(counts, placements, cluster.num_nodes, cluster.gpus_per_node,
                    one_distributed_per_node=pol.one_distributed_per_node, elastic=not pol.gang,
                    order=pol.placement_order(active), node_sizes=cluster.node_sizes)
        sched.append(time.process_time() - t0)
        for j in active:
            old = placements.get(j.name, ())
            p = new.get(j.name, ())
            if tuple(old) != tuple(p):
                j.reallocate(p)
            contention[j.name].append(len(active))
        placements = new
        used = sum(sum(p) for p in new.values())
        util_rows.append((t, used, used / cluster.total_gpus, len(active)))
    if bar is not None:
        bar.close()
    rows = []
    for j in jobs:
        jct = j.completion_time - j.submission_time if j.done else np.nan
        cont = float(np.mean(contention[j.name])) if contention[j.name] else 1.0
        rows.append({
            "name": j.name, "application": j.app.name, "submission_time": j.submission_time,
            "completion_time": j.completion_time, "jct": jct, "restarts": j.restarts,
            "attained_service": j.attained_service, "run_time": j.run_time, "epoch": j.epoch,
            "num_replicas": j.target_replicas, "batch_size": j.target_batch, "contention": cont,
        })
    jdf = pd.DataFrame(rows)
    # finish-time fairness rho (Themis; Pollux §5.3): JCT over the JCT on an exclusive 1/N share of the
    # cluster, N = the job's average contention; the latter approximated as its GPU-seconds / fair GPUs
    fair = cluster.total_gpus / jdf.contention.clip(lower=1.0)
    jdf["ftf"] = jdf.jct / (jdf.attained_service / fair).clip(lower=1.0)
    udf = pd.DataFrame(util_rows, columns=["time", "gpus_used", "utilisation", "active_jobs"])
    res = SimResult(pol.name, name, jdf, udf, sched_seconds=sched)
    res.summary = summarize(jdf, udf)
    res.summary["sched_ms_per_round"] = 1e3 * float(np.mean(sched)) if sched else 0.0  # CPU ms
    res.summary["rounds"] = len(sched)
    return res
