"""The trace-replay cluster simulator (after the Pollux artifact's simulator, pollux-artifact.md §5).

Every ``interval`` seconds (60): advance every submitted job (``SimJob.step``), ask the policy for GPU
counts of the active jobs, place them on ``num_nodes`` x ``gpus_per_node`` GPUs, and re-allocate the jobs
whose placement changed (each change costs the job ``restart_delay`` = 30 s). Ends when every job is done
(or at ``max_time``). Under batch-adaptive policies NCF jobs keep the user's configuration (1 GPU, batch
32768), as in the artifact.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd

from elasticlab.alloc.placement import place
from elasticlab.alloc.policies import Cluster, Policy, get_policy
from elasticlab.sim.checks import check_interval, check_limit, check_max_time, check_restart_delay
from elasticlab.sim.job import SimJob
from elasticlab.sim.metrics import SimResult, summarize
from elasticlab.sim.traces import load_application
from elasticlab.sim.workload import check_workload, load_workload

__all__ = ["simulate", "make_jobs", "MAX_IDLE_ROUNDS"]

#: The most scheduling rounds before the last submission (each round costs a little even when idle): a
#: workload whose last job arrives later than this many intervals is refused up front instead of running
#: for hours (1e6 rounds = 694 days at the default 60 s).
MAX_IDLE_ROUNDS = 1_000_000


def _make_job(row, policy: Policy, restart_delay: float) -> SimJob:
    app = load_application(row.application)
    mode = policy.batch_mode
    pin = row.application == "ncf" and mode != "fixed"
    if pin:
        mode = "fixed"  # the artifact pins NCF to its user config (1 GPU, batch 32768) under Pollux
    job = SimJob(row.name, app, row.time, int(row.num_replicas), int(row.batch_size), mode, restart_delay)
    if pin:
        job.gpu_limit = int(row.num_replicas)
    return job


def make_jobs(workload: pd.DataFrame, policy: Policy, restart_delay: float = 30.0) -> list[SimJob]:
    return [_make_job(row, policy, restart_delay) for row in workload.itertuples(index=False)]


def _job_row(j: SimJob) -> dict:
    jct = j.completion_time - j.submission_time if j.done else np.nan
    return {
        "name": j.name, "application": j.app.name, "submission_time": j.submission_time,
        "completion_time": j.completion_time, "jct": jct, "restarts": j.restarts,
        "attained_service": j.attained_service, "run_time": j.run_time, "epoch": j.epoch,
        "num_replicas": j.target_replicas, "batch_size": j.target_batch,
        "contention": j._cont_sum / j._cont_n if j._cont_n else 1.0,
        "start_time": np.nan if j.start_time is None else j.start_time,
        "queue_delay": np.nan if j.start_time is None else j.start_time - j.submission_time,
    }


def simulate(workload, policy="pollux", cluster: Cluster | str = "16x4", interval: float = 60.0,
             restart_delay: float = 30.0, limit: int | None = None, max_time: float | None = None,
             progress: bool = True, policy_kwargs: dict | None = None) -> SimResult:
    """Replay ``workload`` (a DataFrame, CSV path or shared name like 'workload-6') under ``policy``.

    Scales to whole traces (issue 19): a job exists from its submission to its completion only (memory
    follows the live jobs), only live jobs are advanced, rounds with no live job are skipped (nothing can
    change in them), and the jobs' curves and batch choices are recomputed only when their inputs change
    (:class:`SimJob`). The results are those of advancing every job every round."""
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    interval = check_interval(interval)
    restart_delay = check_restart_delay(restart_delay)
    max_time = check_max_time(max_time)
    limit = check_limit(limit)
    name = str(workload) if not isinstance(workload, pd.DataFrame) else "dataframe"
    if isinstance(workload, pd.DataFrame):
        df = check_workload(workload, "workload (DataFrame)")
        if limit is not None:
            df = df.head(limit)
    else:
        df = load_workload(workload, limit=limit)
    df = df.reset_index(drop=True)
    times = df.time.to_numpy(float)
    last = float(times.max())
    if max_time is None and last / interval > MAX_IDLE_ROUNDS:
        job = df.name.iloc[int(np.argmax(times))]
        raise ValueError(f"job {job!r} is submitted at time {last:g} s, {last / interval:.3g} "
                         f"scheduling rounds of {interval:g} s after the start; a workload may span at most "
                         f"{MAX_IDLE_ROUNDS:.0e} rounds before its last submission (check its time column, "
                         f"or pass max_time to cut the run)")
    pol = get_policy(policy, **(policy_kwargs or {})) if isinstance(policy, str) else policy
    for app in df.application.unique():
        _ = load_application(app).throughput_model  # fit once up front (cached per application)
    n = len(df)
    arrival = np.argsort(times, kind="stable")  # df order among equal times
    rows = df.itertuples(index=False)
    records = list(rows)
    nxt = 0  # next job (in arrival order) not yet submitted
    live: list[tuple[int, SimJob]] = []  # (df index, job), in df order: the order the policies see
    out_rows: dict[int, dict] = {}
    placements: dict = {}
    node_sizes = cluster.node_sizes  # computed once, not every round
    t = 0.0
    util_rows = []
    sched = []
    skipped = 0
    horizon = max_time if max_time is not None else float("inf")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc=f"simulate {pol.name}", unit="job", leave=False)
    n_done = 0
    while t < horizon:
        if not live and nxt < n:  # nothing runs until the next submission: skip the empty rounds
            first = times[arrival[nxt]]
            if t + interval < first:
                util_rows.append((t + interval, 0, 0.0, 0))
            while t + interval < first and t + interval < horizon:
                t += interval  # added round by round: the same float times as stepping every round
                skipped += 1
        for _, j in live:
            j.step(interval)
        t += interval
        added = False
        while nxt < n and times[arrival[nxt]] <= t:
            i = int(arrival[nxt])
            j = _make_job(records[i], pol, restart_delay)
            j.current_time = t  # it waited, unplaced, until this round
            j._cont_sum = j._cont_n = 0
            live.append((i, j))
            added = True
            nxt += 1
        if added:
            live.sort(key=lambda e: e[0])
        finished = [e for e in live if e[1].done]
        if finished:
            for i, j in finished:  # free the GPUs of finished jobs; keep only their results
                if j.placement:
                    j.reallocate(())
                placements.pop(j.name, None)
                out_rows[i] = _job_row(j)
            live = [e for e in live if not e[1].done]
            n_done += len(finished)
            if bar is not None:
                bar.update(len(finished))
        if n_done == n:
            break
        active = [j for _, j in live]
        t0 = time.process_time()  # CPU seconds: robust to other load on the machine
        counts = pol.allocate(active, t, cluster) if active else {}
        new = place(counts, placements, cluster.num_nodes, cluster.gpus_per_node,
                    one_distributed_per_node=pol.one_distributed_per_node, elastic=not pol.gang,
                    order=pol.placement_order(active), node_sizes=node_sizes)
        sched.append(time.process_time() - t0)
        used = 0  # the GPUs held after this round (each job's count is cached: no sum over the nodes)
        for j in active:
            old = placements.get(j.name, ())
            p = new.get(j.name, ())
            if tuple(old) != tuple(p):
                j.reallocate(p)
            j._cont_sum += len(active)
            j._cont_n += 1
            used += j.gpus
        placements = new
        util_rows.append((t, used, used / cluster.total_gpus, len(active)))
        if bar is not None and len(sched) % 200 == 0:
            bar.set_postfix_str(f"t={t / 3600:.0f} h, {len(active)} running", refresh=False)
    if bar is not None:
        bar.close()
    for i, j in live:
        out_rows[i] = _job_row(j)
    for k in range(nxt, n):  # never submitted before max_time
        r = records[int(arrival[k])]
        out_rows[int(arrival[k])] = {
            "name": r.name, "application": r.application, "submission_time": float(r.time),
            "completion_time": None, "jct": np.nan, "restarts": 0, "attained_service": 0.0, "run_time": 0.0,
            "epoch": 0, "num_replicas": int(r.num_replicas), "batch_size": int(r.batch_size),
            "contention": 1.0, "start_time": np.nan, "queue_delay": np.nan}
    jdf = pd.DataFrame([out_rows[i] for i in range(n)])
    # finish-time fairness rho (Themis; Pollux §5.3): JCT over the JCT on an exclusive 1/N share of the
    # cluster, N = the job's average contention; the latter approximated as its GPU-seconds / fair GPUs
    fair = cluster.total_gpus / jdf.contention.clip(lower=1.0)
    jdf["ftf"] = jdf.jct / (jdf.attained_service / fair).clip(lower=1.0)
    udf = pd.DataFrame(util_rows, columns=["time", "gpus_used", "utilisation", "active_jobs"])
    res = SimResult(pol.name, name, jdf, udf, sched_seconds=sched)
    res.summary = summarize(jdf, udf)
    res.summary["sched_ms_per_round"] = 1e3 * float(np.mean(sched)) if sched else 0.0  # CPU ms
    res.summary["rounds"] = len(sched)
    res.summary["idle_rounds_skipped"] = skipped
    return res
