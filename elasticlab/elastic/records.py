"""Thread-safe, append-only logs of per-step metrics and job events (cheap to poll from a UI timer)."""
from __future__ import annotations

import statistics
import threading
import time
from typing import NamedTuple

#: Keys of a per-step metrics record (``ElasticJob.metrics()``).
METRIC_KEYS = ("step", "epoch", "time", "loss", "samples_per_s", "step_time", "world_size",
               "per_worker_batch", "accum_steps", "global_batch", "lr", "gns", "predicted_goodput",
               "generation")

#: Kinds of events (``ElasticJob.events()``). ``resize``: a resize done (``from_size``, ``to_size``,
#: ``latency_s``); ``pause``: the job paused; ``resumed``: a resume from pause done (``world_size``,
#: ``latency_s``); ``resume``: a generation's workers loaded the state it formed from (every generation);
#: ``record_gap``: no checkpoint at or before the step through which the sample record holds every rank's
#: rows was left, so the job went on from a newer one and the record misses rows.
EVENT_KINDS = ("start", "ready", "generation", "resize", "set_batch", "adapt", "checkpoint",
               "checkpoint_corrupt", "resume", "pause", "resumed", "fault", "restart", "finished", "stop",
               "error", "abort", "retry", "no_checkpoint", "failed", "error_explained",
               "record_gap")


class StepTime(NamedTuple):
    """One measured step time in a configuration: a row of a throughput-model fit (Pollux §4.1; the
    columns of :data:`elasticlab.goodput.fit.OBSERVATION_COLUMNS` without ``sync_time``)."""

    nodes: int
    gpus: int
    per_gpu_batch: int
    accum_steps: int
    iter_time: float


def step_time_rows(records, skip_first: int = 1, aggregate: bool = False) -> list[StepTime]:
    """:class:`StepTime` rows from per-step metrics records, for a throughput-model fit (Pollux §4.1): the
    first ``skip_first`` steps of each generation (warm-up) and epoch-tail steps are left out; nodes = 1
    (one machine). ``aggregate=True``: one row per configuration (median time)."""
    rows, seen = [], {}
    for r in records:
        g = r.get("generation")
        seen[g] = seen.get(g, 0) + 1
        if seen[g] > skip_first and r["samples"] == r["global_batch"]:
            rows.append(StepTime(1, r["world_size"], r["per_worker_batch"], r["accum_steps"], r["step_time"]))
    if aggregate:
        groups: dict = {}
        for row in rows:
            groups.setdefault(row[:4], []).append(row.iter_time)
        rows = [StepTime(*k, float(statistics.median(v))) for k, v in sorted(groups.items())]
    return rows


class RecordLog:
    """An append-only list of dicts guarded by a lock; readers get copies of a slice."""

    def __init__(self):
        self._rows: list[dict] = []
        self._lock = threading.Lock()

    def append(self, row: dict) -> None:
        with self._lock:
            self._rows.append(row)

    def since(self, start: int = 0) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._rows[start:]]

    def last(self, kind: str | None = None) -> dict | None:
        with self._lock:
            for r in reversed(self._rows):
                if kind is None or r.get("kind") == kind:
                    return dict(r)
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)


class EventLog(RecordLog):
    """Events carry ``kind``, wall-clock ``time`` and ``t`` (seconds since the log was created)."""

    def __init__(self):
        super().__init__()
        self.t0 = time.time()

    def emit(self, kind: str, **fields) -> dict:
        now = time.time()
        row = {"kind": kind, "time": now, "t": round(now - self.t0, 4), **fields}
        self.append(row)
        return row
