"""The three-job comparison of :mod:`elasticlab.cluster.experiments` on Ray, optionally losing a node.

:func:`run_on_ray` runs the jobs under one policy on a :class:`~elasticlab.cluster.ray.RayCluster` and, from
``kill_node_at`` seconds on, removes the first worker node on which a job trains at that moment
(:func:`~elasticlab.cluster.ray.local.kill_busy_node`); the node is added back afterwards so that every
policy starts from the same cluster. :func:`compare_on_ray` does that per
policy on one local multi-node cluster (:func:`~elasticlab.cluster.ray.local.local_cluster`).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from elasticlab.cluster.experiments import three_jobs


def _resize_latencies(cl) -> dict:
    """Per resize of the run (request to the first step at the new size): all, shrinks, grows (s)."""
    out = {"all": [], "shrink": [], "grow": []}
    for e in cl.events():
        if e["kind"] == "resize_done" and isinstance(e.get("result"), dict) and e.get("from_size"):
            lat = float(e["result"]["latency_s"])
            out["all"].append(lat)
            out["shrink" if e["n"] < e["from_size"] else "grow"].append(lat)
    return out


def run_on_ray(policy: str, cluster, *, specs=None, quick: bool = False, interval: float = 1.0,
               timeout: float = 600.0, kill_node_at: float | None = None, record_dir: str | None = None,
               workdir: str | None = None, slots_per_node: int = 2) -> dict:
    """Run ``specs`` (default :func:`~elasticlab.cluster.experiments.three_jobs`) under ``policy`` on the
    Ray cluster ``cluster`` (a ``ray.cluster_utils.Cluster``, Ray connected to it); see the module doc."""
    import ray

    from elasticlab.cluster.ray.cluster import RayCluster
    from elasticlab.cluster.ray.local import kill_busy_node

    specs = specs if specs is not None else three_jobs(quick)
    if record_dir is not None:
        Path(record_dir).mkdir(parents=True, exist_ok=True)
        for s in specs:
            s.record_samples = str(Path(record_dir) / f"{s.name}.jsonl")
    head = ray.get_runtime_context().get_node_id()
    t0 = time.perf_counter()
    cl = RayCluster(policy, interval, workdir=workdir or tempfile.mkdtemp(prefix=f"elasticlab-ray-{policy}-"))
    killed = None
    try:
        for s in specs:
            cl.submit(s)
        cl.start()
        end = time.monotonic() + timeout
        while not cl.wait(timeout=0.2) and time.monotonic() < end:
            if kill_node_at is not None and killed is None and cl.now() >= kill_node_at:
                try:  # a worker node on which a job trains at that moment
                    node, jobs = kill_busy_node(cluster, cl, exclude=(head,),
                                                timeout_s=max(1.0, min(120.0, end - time.monotonic())))
                    killed = {"t": cl.now(), "node": node, "jobs": jobs}
                except TimeoutError as e:  # no job trained on a worker node until then
                    killed = {"t": None, "node": None, "jobs": [], "error": str(e)[:300]}
        ok = cl.wait(timeout=0)
        out = cl.summary()
        out["timed_out"] = not ok
        out["samples_ok"] = {s.name: bool(cl.sample_check(s.name)["ok"]) for s in specs
                             if s.record_samples and out["states"].get(s.name) == "finished"}
        out["lost_steps"] = {s.name: cl.job(s.name).status()["lost_steps"] for s in specs
                             if cl.job(s.name) is not None}
        out["faults"] = {s.name: cl.job(s.name).status()["faults"] for s in specs
                         if cl.job(s.name) is not None}
        out["resize_latency_s"] = _resize_latencies(cl)
        out["history"] = cl.history()
    finally:
        cl.stop()
    if killed is not None and killed["node"] is not None:  # the next policy gets the same cluster
        from elasticlab.cluster.ray.local import add_node

        add_node(cluster, slots_per_node, resource=cl.resource)
    out["killed"] = killed
    out["wall_s"] = time.perf_counter() - t0
    return out


def median(xs):
    return statistics.median(xs) if xs else None


def compare_on_ray(policies=("equal_share", "goodput"), *, nodes: int = 3, slots_per_node: int = 2,
                   quick: bool = False, interval: float = 1.0, timeout: float = 600.0,
                   kill_node_at: float | None = None, record_dir: str | None = None,
                   progress: bool = False) -> dict:
    """:func:`run_on_ray` per policy on one local cluster of ``nodes`` x ``slots_per_node``:
    ``{"<policy>_avg_jct": s, "runs": {policy: run}}``."""
    from elasticlab.cluster.ray.local import local_cluster, shutdown

    cluster = local_cluster(nodes, slots_per_node)
    out: dict = {"runs": {}, "nodes": nodes, "slots_per_node": slots_per_node, "quick": bool(quick)}
    it = policies
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(policies, desc="policies on Ray")
    try:
        for p in it:
            rec = str(Path(record_dir) / p) if record_dir else None
            run = run_on_ray(p, cluster, quick=quick, interval=interval, timeout=timeout,
                             kill_node_at=kill_node_at, record_dir=rec, slots_per_node=slots_per_node)
            out["runs"][p] = run
            out[f"{p}_avg_jct"] = run["avg_jct"]
    finally:
        shutdown(cluster)
    return out
