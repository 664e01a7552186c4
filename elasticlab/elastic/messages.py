"""The messages between an :class:`~elasticlab.elastic.ElasticJob` and its pool workers, and the commands
rank 0 relays through each step's all-reduce. Both sides import this module; each message is a small
typed record (a ``NamedTuple``: pickled over the worker's pipe as it is).
"""
from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple


class Command(IntEnum):
    """What rank 0 puts into the all-reduce that ends a step; every rank acts on it after that step."""

    NONE = 0
    LEAVE = 1  # checkpoint (rank 0) and leave the group
    SET_BATCH = 2  # go on with (global_batch, accum_steps)
    CHECKPOINT = 3  # checkpoint now


CMD_NONE, CMD_LEAVE, CMD_SET_BATCH, CMD_CHECKPOINT = Command


# ---- job -> worker ------------------------------------------------------------------------------

class Join(NamedTuple):
    """Form generation ``generation`` as ``rank`` of ``world_size`` on the store at ``host:port``.

    The controller decides a generation's membership and rank numbering once, here; a worker never derives
    its rank itself. The generation number is also the store prefix (``gen<N>/``), and every generation
    has a fresh store: a member of an abandoned formation never meets a member of the next one."""

    generation: int
    rank: int
    world_size: int
    port: int
    checkpoint: str | None  # the checkpoint to load (None: the task's initial state, same seed)
    checkpoint_dir: str
    batch: tuple[int, int] | None  # (global_batch, accum_steps), None: keep the current one
    host: str = "127.0.0.1"  # the store's address (a node's own address on a multi-node cluster)


class Control(NamedTuple):
    """A command for rank 0 of generation ``generation`` (a later generation drops it)."""

    generation: int
    command: Command
    global_batch: int = 0
    accum_steps: int = 0

    @property
    def vector(self) -> tuple[int, int, int]:
        """The ``(command, global_batch, accum_steps)`` a step all-reduces."""
        return (int(self.command), self.global_batch, self.accum_steps)


class Exit(NamedTuple):
    """End the worker process."""


# ---- worker -> job ------------------------------------------------------------------------------

class Ready(NamedTuple):
    """The worker built its task and waits for a :class:`Join`."""

    worker_id: int
    pid: int


class Step(NamedTuple):
    """Rank 0's record of one step (keys: :data:`elasticlab.elastic.records.METRIC_KEYS`)."""

    record: dict


class Samples(NamedTuple):
    """One rank's sample indices of one step (a row of the JSONL sample record)."""

    row: dict


class Checkpointed(NamedTuple):
    """Rank 0 saved a checkpoint; ``reason`` is initial, periodic or leave."""

    generation: int
    step: int
    path: str
    probe_loss: float | None
    reason: str


class Resumed(NamedTuple):
    """Rank 0 loaded ``checkpoint`` (None: started from the seed) and is at ``step``."""

    generation: int
    step: int
    probe_loss: float
    checkpoint: str | None
    formed_s: float | None = None  # store connect + process group + DDP, on rank 0
    backend: str | None = None  # the process group's: "gloo" on CPU, "nccl" on GPUs


class Scheduled(NamedTuple):
    """Rank 0 leaves after ``step`` for the schedule, which asks for ``world_size`` workers from then."""

    generation: int
    step: int
    world_size: int


class Left(NamedTuple):
    """Rank 0 left the group after ``step``."""

    generation: int
    step: int


class Finished(NamedTuple):
    """Rank 0 did all the work and saved the final checkpoint."""

    generation: int
    step: int
    path: str
    probe_loss: float


class Idle(NamedTuple):
    """The worker left generation ``generation`` and waits for the next :class:`Join`."""

    worker_id: int
    generation: int


#: What an :class:`Error` is about (see :data:`elasticlab.elastic.states.FAILURE_SEMANTICS`).
ERROR_KINDS = ("build", "task", "checkpoint_io", "checkpoint_load", "formation", "comm")


class Error(NamedTuple):
    """The worker failed in ``generation`` (None: building the task failed; nothing will work).

    ``kind`` (one of :data:`ERROR_KINDS`) says where: building the task, the task's own code, writing a
    checkpoint, loading ``path``, forming the group, or a collective/store failing under it (a peer died
    or left). ``traceback`` is the worker's full formatted traceback."""

    worker_id: int
    generation: int | None
    text: str
    kind: str = "task"
    traceback: str = ""
    path: str | None = None  # the checkpoint a checkpoint_load error is about
