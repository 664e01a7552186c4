"""The cluster experiment the tests, the benchmark and ``elasticlab reproduce`` share.

:func:`three_jobs` -- three small real jobs of different scaling behaviour (``examples/cluster_jobs.py``):
a communication-bound tiny model, a compute-bound MLP and a job whose gradient noise scale grows fast,
submitted in that order. :func:`run_workload` runs them on a :class:`LocalCluster` under one policy and
checks every job's sample record; :func:`compare_policies` does that per policy, one after the other in
the same process, and reports each policy's average JCT (``<policy>_avg_jct``).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from elasticlab.cluster.cluster import LocalCluster
from elasticlab.cluster.spec import JobSpec


def examples_path() -> str:
    """``examples/cluster_jobs.py`` of this checkout."""
    p = Path(__file__).resolve().parents[2] / "examples" / "cluster_jobs.py"
    if not p.is_file():
        raise FileNotFoundError(f"the example jobs are missing: {p}")
    return str(p)


def three_jobs(quick: bool = False, record_samples: bool = True, work: float | None = None) -> list[JobSpec]:
    """The three jobs (fresh specs). ``work`` scales their epochs of digits (``quick``: 0.5)."""
    ex = examples_path()
    w = float(work if work is not None else (0.5 if quick else 1.0))
    if not w > 0:
        raise ValueError(f"work must be > 0, got {work!r}")

    def ep(n):
        return max(int(round(n * w)), 1)

    common = {"record_samples": record_samples, "lr_rule": "adascale", "checkpoint_every": 50,
              "initial_batch": 32}
    return [
        JobSpec(f"{ex}:comm_bound", name="comm", epochs=ep(6), max_batch=256,
                per_slot_batch=(4, 256), warm=2, **common),
        JobSpec(f"{ex}:compute_bound", name="compute", epochs=ep(4), max_batch=128,
                per_slot_batch=(4, 64), warm=3, **common),
        JobSpec(f"{ex}:gns_growing", name="gns", epochs=ep(6), max_batch=256,
                per_slot_batch=(4, 128), warm=2, **common),
    ]


def warm_up() -> None:
    """Start the workers' forkserver (torch and scikit-learn imported once) before any timed run, so that
    the first policy compared does not pay for it alone."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    import sklearn.datasets  # noqa: F401  (the example tasks' data, also counted in this process)

    mp.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "elasticlab.elastic.worker", "sklearn.datasets"])
    forkserver.ensure_running()


def run_workload(policy: str, specs: list[JobSpec] | None = None, *, slots: int = 4, interval: float = 1.0,
                 timeout: float = 300.0, quick: bool = False, check_samples: bool = True,
                 **cluster_kwargs) -> dict:
    """Run ``specs`` (default :func:`three_jobs`) under ``policy``; return the cluster's summary plus
    ``samples_ok`` (exactly-once per job), ``history`` (slots over time) and ``wall_s``."""
    specs = specs if specs is not None else three_jobs(quick)
    t0 = time.perf_counter()
    cl = LocalCluster(slots=slots, policy=policy, interval=interval, **cluster_kwargs)
    try:
        for s in specs:
            cl.submit(s)
        out = cl.run(timeout=timeout)
        out["history"] = cl.history()
        out["events"] = [e for e in cl.events() if e["kind"] in ("start", "resize", "set_batch", "pause",
                                                                  "resume", "finished", "failed")]
        if check_samples:
            out["samples_ok"] = {}
            for s in specs:
                if s.record_samples and out["states"].get(s.name) == "finished":
                    rep = cl.sample_check(s.name)
                    out["samples_ok"][s.name] = bool(rep["ok"]) and all(
                        not e["missing"] for e in rep["epochs"].values())
    finally:
        cl.stop()
    out["wall_s"] = time.perf_counter() - t0
    return out


def compare_policies(policies=("goodput", "equal_share"), *, quick: bool | None = None, slots: int = 4,
                     interval: float = 1.0, timeout: float = 300.0, progress: bool = False) -> dict:
    """Run the three jobs under each policy in turn: ``{"<policy>_avg_jct": s, "runs": {policy: run}}``."""
    if quick is None:
        quick = os.environ.get("ELASTICLAB_QUICK", "0") == "1"
    out: dict = {"runs": {}, "slots": slots, "quick": bool(quick)}
    warm_up()
    it = policies
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(policies, desc="policies")
    for p in it:
        run = run_workload(p, slots=slots, interval=interval, timeout=timeout, quick=quick)
        out["runs"][p] = run
        out[f"{p}_avg_jct"] = run["avg_jct"]
    return out
