"""Lifecycle states of a job and its workers, the allowed transitions, and the job's status record.

As ``torch.distributed.elastic`` keeps an enum of worker states, the job's states are :class:`JobState`
and its pool workers' :class:`WorkerState`; both compare equal to their plain-string values. A job's
status snapshot is a :class:`JobStatus` (an :class:`ElasticJobStatus` or a :class:`TorchrunJobStatus`),
read like the dict it used to be (``status()["step"]``, ``.get``, ``keys``, ``**status``).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from enum import Enum
from typing import Any


class StrEnum(str, Enum):
    """A string enum whose ``str`` and ``format`` give the plain value (``enum.StrEnum`` from 3.11)."""

    __str__ = str.__str__
    __format__ = str.__format__


class JobState(StrEnum):
    """A job's lifecycle state (see :data:`TRANSITIONS`).

    **Failure semantics** of an :class:`~elasticlab.elastic.ElasticJob` (the kind of a worker's error is
    :data:`elasticlab.elastic.messages.ERROR_KINDS`):

    =======================================  ===========================================================
    what went wrong                          what the job does
    =======================================  ===========================================================
    the task cannot be built (``build``)     FAILED at once (nothing would work)
    the task's code raised (``task``)        FAILED within a second or so (after 0.5 s in which no
                                             peer died: a death's echo in a collective is no task
                                             error): ``status().error`` has the
                                             message, ``status().traceback`` the worker's traceback;
                                             with ``max_restarts=K`` it restarts from the newest valid
                                             checkpoint instead, at most K times in the job's life
    writing a checkpoint failed              as a task error (an unwritable or vanished checkpoint
    (``checkpoint_io``: OSError)             directory, a full disk): FAILED unless ``max_restarts``
    a checkpoint does not load               that file is set aside like a corrupt one (event
    (``checkpoint_load``: header and         ``checkpoint_corrupt``) and the generation re-forms from
    SHA-256 good, ``weights_only=True``      the previous checkpoint
    refuses the pickle, or it does not fit)
    no loadable checkpoint is left           every rank restarts from the task's initial state (same
                                             seed, sampler at the first epoch's start); the steps rolled
                                             back are counted (``lost_steps``, ``replays``, event
                                             ``restart``) -- or FAILED with ``on_no_checkpoint="fail"``
    a worker process died (SIGKILL, exit)    the generation is abandoned, a replacement is started and
                                             the job resumes from the newest valid checkpoint (default,
                                             as before; no limit while the job makes progress)
    the group cannot form or breaks          the generation is abandoned (its store is closed, so the
    (``formation``/``comm``: a member died   others stop waiting at once) and formed again with a new
    while forming, a rendezvous or           generation number; ``max_failed_generations`` (default 5)
    collective timed out, a peer left)       generations in a row that end so without taking the job
                                             past its furthest step make it FAILED, with the last error
    the controller thread itself failed      FAILED ("controller failed: ..."); every process is killed
    =======================================  ===========================================================

    The retry policy is thus: worker *deaths* and broken groups are retried (bounded by
    ``max_failed_generations`` when no progress is made), worker *exceptions* are not (``max_restarts``,
    default 0). Once FAILED, :meth:`~elasticlab.elastic.ElasticJob.wait` returns, pending request futures
    raise, and no worker process is left.
    """

    NEW = "new"  # built, not started
    STARTING = "starting"  # the pool's first workers are starting
    SPAWNING = "spawning"  # replacing or adding workers before the next generation
    RUNNING = "running"  # a generation is training
    DRAINING = "draining"  # the generation is leaving its group at a step boundary
    PAUSED = "paused"  # no generation; the processes stay warm
    FINISHED = "finished"  # all the work is done
    STOPPED = "stopped"  # stopped on request
    FAILED = "failed"  # could not go on


#: States a job never leaves; also the live cluster's (which adds its own ``"dropped"``).
TERMINAL = (JobState.FINISHED, JobState.STOPPED, JobState.FAILED)

_ANY = frozenset(JobState) - frozenset(TERMINAL)

#: The allowed transitions of an :class:`~elasticlab.elastic.ElasticJob`, checked at every change; a
#: state may always be set again. Any state that is not terminal may fail (a worker cannot build the
#: task, or the controller itself fails).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.NEW: frozenset({JobState.STARTING, JobState.STOPPED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.SPAWNING}),  # the first generation forms
    JobState.SPAWNING: frozenset({JobState.RUNNING}),  # enough idle workers: the generation forms
    JobState.RUNNING: frozenset({JobState.DRAINING}),  # resize, pause, stop, fault, schedule, finished
    JobState.DRAINING: frozenset({JobState.RUNNING, JobState.SPAWNING, JobState.PAUSED,
                                  JobState.FINISHED, JobState.STOPPED}),
    JobState.PAUSED: frozenset({JobState.RUNNING, JobState.SPAWNING, JobState.STOPPED}),
    JobState.FINISHED: frozenset(),
    JobState.STOPPED: frozenset(),
    JobState.FAILED: frozenset(),
}
for _s in _ANY:
    TRANSITIONS[_s] = TRANSITIONS[_s] | {JobState.FAILED}


def check_transition(old: JobState, new: JobState) -> None:
    """Raise :class:`RuntimeError` unless ``old -> new`` is in :data:`TRANSITIONS` (or ``new == old``)."""
    if new != old and new not in TRANSITIONS[JobState(old)]:
        raise RuntimeError(f"job state cannot go from {old!s} to {new!s}")


def wait_terminal(state_of, timeout: float | None = None, poll_s: float = 0.05) -> bool:
    """Poll ``state_of()`` until it is in :data:`TERMINAL`; False when ``timeout`` seconds pass first."""
    end = None if timeout is None else time.monotonic() + timeout
    while state_of() not in TERMINAL:
        if end is not None and time.monotonic() > end:
            return False
        time.sleep(poll_s)
    return True


class OnNoCheckpoint(StrEnum):
    """What a job does when no loadable checkpoint is left (``on_no_checkpoint``; see :class:`JobState`)."""

    RESTART = "restart"  # every rank restarts from the task's initial state; the steps lost are counted
    FAIL = "fail"  # the job fails


class DrainReason(StrEnum):
    """Why a generation leaves its group (state DRAINING), and so what follows once it has left."""

    RESIZE = "resize"  # a new generation at the target size
    FAULT = "fault"  # a member died or errored: a new generation from the newest valid checkpoint
    PAUSE = "pause"  # PAUSED, the processes warm
    STOP = "stop"  # STOPPED, the processes ended
    FINISHED = "finished"  # FINISHED: all the work is done


class WorkerState(StrEnum):
    """A pool worker process's state."""

    STARTING = "starting"  # importing torch, building the task
    IDLE = "idle"  # ready, in no group
    ACTIVE = "active"  # a member of the current generation
    DEAD = "dead"  # exited (or killed)


@dataclasses.dataclass(frozen=True, eq=False)
class JobStatus(Mapping):
    """What every job handle's ``status()`` reports; reads as a read-only mapping of its fields."""

    state: str
    world_size: int
    target_world_size: int
    step: int
    epoch: int
    loss: float | None
    samples_per_s: float | None
    global_batch: int | None
    accum_steps: int | None
    per_worker_batch: int | None
    gns: float | None
    generation: int | None
    error: str | None

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict:
        """A plain dict of the fields (e.g. for JSON)."""
        return {k: getattr(self, k) for k in self._names()}


@dataclasses.dataclass(frozen=True, eq=False)
class ElasticJobStatus(JobStatus):
    """:meth:`ElasticJob.status <elasticlab.elastic.ElasticJob.status>`: the common fields, the machine's
    slots, the predicted goodput, the pool's workers (``{id: {"pid", "state", "rank"}}``), the steps lost
    to faults and rollbacks (``lost_steps``) and how many rollbacks there were (``replays``), the task
    errors retried under ``max_restarts`` (``restarts``), the failing worker's ``traceback`` (with
    ``error``), and where checkpoints and samples go."""

    slots: int = 0
    predicted_goodput: float | None = None
    workers: dict = dataclasses.field(default_factory=dict)
    lost_steps: int = 0
    replays: int = 0
    restarts: int = 0
    traceback: str | None = None
    checkpoint_dir: str | None = None
    record_samples: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class TorchrunJobStatus(JobStatus):
    """:meth:`TorchrunJob.status <elasticlab.cluster.torchrun.TorchrunJob.status>`: the common fields and
    the number of live torchrun agents."""

    agents: int = 0
