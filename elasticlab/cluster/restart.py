"""The measured cost of a re-allocation: Pollux's restart delay delta (Qiao et al. §4.2), from real resizes.

Pollux multiplies a job's speedup at every allocation other than its current one by
``max(T - R delta, 0) / (T + delta)`` (:func:`elasticlab.alloc.objective.restart_penalty`), with delta = 30 s
assumed.
Here delta is measured: every resize of a live job reports its latency (request to the first step at the
new size, :meth:`elasticlab.elastic.ElasticJob.resize`), and :class:`RestartCost` keeps their median.
"""
from __future__ import annotations

import statistics
import time

from elasticlab.checks import seconds


class RestartCost:
    """Median of the measured resize latencies (seconds), ``prior_s`` until the first one."""

    def __init__(self, prior_s: float = 2.0):
        self.prior_s = seconds("prior_s", prior_s, zero_ok=True)
        self.samples: list[float] = []

    def observe(self, latency_s: float) -> None:
        if latency_s is not None and latency_s >= 0:
            self.samples.append(float(latency_s))

    @property
    def estimate(self) -> float:
        return statistics.median(self.samples) if self.samples else self.prior_s

    def penalty(self, age, restarts):
        """Pollux §4.2's factor with the measured delta."""
        from elasticlab.alloc.objective import restart_penalty

        return restart_penalty(age, restarts, self.estimate)

    def as_dict(self) -> dict:
        return {"estimate_s": self.estimate, "measured": len(self.samples), "prior_s": self.prior_s,
                "samples_s": list(self.samples)}


def measure_restart_cost(entrypoint, sizes=(1, 2, 1), *, steps_between: int = 3, timeout: float = 120.0,
                         **job_kwargs) -> dict:
    """Run ``entrypoint`` as an ElasticJob through ``sizes`` and time each resize (request to first step).

    Returns ``{"latencies_s", "median_s"}``. ``job_kwargs`` go to :class:`~elasticlab.elastic.ElasticJob`.
    """
    from elasticlab.elastic import ElasticJob
    from elasticlab.elastic.states import TERMINAL

    sizes = [int(s) for s in sizes]
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"sizes must list >= 2 world sizes >= 1, got {sizes!r}")
    job_kwargs.setdefault("slots", max(sizes))
    job_kwargs.setdefault("warm", max(sizes))
    job_kwargs.setdefault("max_steps", 10_000)
    job = ElasticJob(entrypoint, workers=sizes[0], **job_kwargs)
    lat = []
    end = time.monotonic() + timeout
    try:
        job.start()
        for n in sizes[1:]:
            target = job.status()["step"] + steps_between
            while job.status()["step"] < target:
                if job.state in TERMINAL or time.monotonic() > end:
                    raise RuntimeError(f"the probe job ended or timed out (state {job.state})")
                time.sleep(0.02)
            lat.append(float(job.resize(n).result(max(1.0, end - time.monotonic()))["latency_s"]))
    finally:
        job.stop(timeout=20)
    return {"latencies_s": lat, "median_s": statistics.median(lat)}
