"""What the caller asks of an :class:`~elasticlab.elastic.ElasticJob`, as one typed record.

The public API (:mod:`.job`) queues a :class:`Request`; the controller thread (:mod:`.controller`) takes it
at a step boundary, keeps it while it is under way (``JobController._pending``, by :class:`Kind`) and
resolves its future once the job has done it.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future

from elasticlab.elastic.policies import BatchConfig
from elasticlab.elastic.states import StrEnum


class Kind(StrEnum):
    """A request's kind (equal to its plain-string value)."""

    RESIZE = "resize"  # re-form at ``n`` workers (optionally with ``batch``)
    SET_BATCH = "set_batch"  # go on with ``batch`` from the next step boundary
    CHECKPOINT = "checkpoint"  # checkpoint at the next step boundary
    PAUSE = "pause"  # checkpoint and leave the group; the processes stay warm
    RESUME = "resume"  # form a generation again (at ``n`` workers, if given)
    STOP = "stop"  # checkpoint and end the processes
    RESIZE_DONE = "resize_done"  # a resize (or resume) whose generation formed, until its first step


@dataclasses.dataclass
class Request:
    """One request and what the controller learns while doing it."""

    kind: Kind
    future: Future
    t_request: float  # time.perf_counter() when asked (a resize's latency runs from here)
    n: int | None = None  # resize / resume: the world size asked for
    batch: BatchConfig | None = None  # resize / set_batch: the batch asked for (None: keep or decide)
    from_size: int | None = None  # resize: the world size it started from
    generation: int | None = None  # resize / resume: the generation formed for it
    step: int | None = None  # set_batch: the last step when it was taken
    min_step: int = 0  # checkpoint: the first step a checkpoint may have to satisfy it
    scheduled: int | None = None  # a resize from the job's schedule: the step it was scheduled after
