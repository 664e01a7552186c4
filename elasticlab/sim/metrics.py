"""Simulation results: per-job DataFrame, utilisation series, and the summary metrics.

avg / median / p99 JCT, makespan, mean GPU utilisation (allocated GPU share while jobs are active),
restarts, jobs completed / dropped, average queueing delay (submission to first GPUs), and finish-time
fairness rho = JCT / (JCT with 1/J_avg of the cluster), approximated as in Themis/Pollux by JCT over the
job's isolated run time times its average contention.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

__all__ = ["SimResult", "summarize"]


def summarize(jobs: pd.DataFrame, util: pd.DataFrame | None = None) -> dict:
    done = jobs[jobs.completion_time.notna()]
    jct = (done.completion_time - done.submission_time).to_numpy(float)
    out = {
        "jobs": int(len(jobs)),
        "completed": int(len(done)),
        "dropped": int(jobs.get("dropped", pd.Series(False, index=jobs.index)).sum()),
        "avg_jct": float(np.mean(jct)) if len(jct) else float("nan"),
        "median_jct": float(np.median(jct)) if len(jct) else float("nan"),
        "p99_jct": float(np.percentile(jct, 99)) if len(jct) else float("nan"),
        "makespan": (float(done.completion_time.max() - jobs.submission_time.min()) if len(done)
                     else float("nan")),
        "restarts": int(jobs.restarts.sum()) if "restarts" in jobs else 0,
    }
    if util is not None and len(util):
        busy = util[util.active_jobs > 0]
        out["gpu_utilisation"] = float(busy.utilisation.mean()) if len(busy) else 0.0
    if "queue_delay" in jobs:  # submission to first GPUs, over the jobs that started
        q = jobs.queue_delay.to_numpy(float)
        q = q[np.isfinite(q)]
        out["avg_queue_delay"] = float(np.mean(q)) if len(q) else float("nan")
    if "ftf" in jobs and len(done):
        f = done.ftf.to_numpy(float)
        out["ftf_p99"] = float(np.nanpercentile(f, 99))
        out["ftf_frac_below_2"] = float(np.nanmean(f < 2))
    return out


@dataclass
class SimResult:
    """``jobs``: one row per job; ``utilisation``: one row per scheduling round; ``summary``: metrics."""

    policy: str
    workload: str
    jobs: pd.DataFrame
    utilisation: pd.DataFrame
    summary: dict = field(default_factory=dict)
    sched_seconds: list = field(default_factory=list)

    @property
    def jcts(self) -> np.ndarray:
        d = self.jobs[self.jobs.completion_time.notna()]
        return (d.completion_time - d.submission_time).to_numpy(float)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "workload": self.workload, "summary": self.summary,
                "jobs": json.loads(self.jobs.to_json(orient="records")),
                "utilisation": {c: self.utilisation[c].tolist() for c in self.utilisation.columns}}

    def to_json(self, path=None) -> str:
        text = json.dumps(self.to_dict())
        if path is not None:
            import os
            import tempfile

            d = os.path.dirname(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)  # atomic
        return text
