"""ElasticSampler: every index of an epoch is consumed exactly once, across any number of resizes.

The sampler owns a per-epoch permutation (seeded by ``seed + epoch``) and a single global cursor
``position``. A step takes the next ``global_batch`` indices of the permutation (fewer at the end of
an epoch: a step never crosses an epoch boundary) and splits them as evenly as possible across the
ranks and accumulation micro-batches of the *current* world size. Because the cursor is global, the
world size may change between any two steps without skipping or repeating an index; checkpointing
``state_dict()`` at a step boundary is all that a resize or a restart needs.
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from elasticlab.checks import whole


class ElasticSampler:
    """Global-cursor sampler over ``range(num_samples)``; see the module docstring."""

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True):
        self.num_samples = whole("num_samples", num_samples, 1, "a positive integer")
        self.seed = whole("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int | None = None) -> np.ndarray:
        """The order of epoch ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    @property
    def remaining(self) -> int:
        return self.num_samples - self.position

    def step_indices(self, global_batch: int) -> np.ndarray:
        """The indices the next step consumes (all ranks together), without advancing."""
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch!r}")
        n = min(int(global_batch), self.remaining)
        return self.permutation()[self.position:self.position + n]

    def shard(self, global_batch: int, world_size: int, rank: int) -> np.ndarray:
        """The part of the next step that ``rank`` of ``world_size`` consumes (sizes differ by <= 1)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is outside a world of size {world_size!r}")
        return np.array_split(self.step_indices(global_batch), world_size)[rank]

    def advance(self, global_batch: int) -> None:
        """Mark the next step consumed; roll over to the next epoch when this one is used up."""
        self.position += min(int(global_batch), self.remaining)
        if self.position >= self.num_samples:
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"checkpointed sampler covers {state['num_samples']} samples, "
                             f"this dataset has {self.num_samples}")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._perm_epoch = -1


def micro_batches(indices: np.ndarray, accum_steps: int) -> list[np.ndarray]:
    """Split one rank's indices into ``accum_steps + 1`` micro-batches (sizes differ by <= 1)."""
    return np.array_split(indices, int(accum_steps) + 1)


def read_record(path, *, missing_ok: bool = False, lenient: bool = False) -> list[dict]:
    """The rows of a JSONL sample record. A last line with no newline that does not parse is the write of a
    process that died in it, and is passed over (its rows are lost: the checks see them missing); a bad line
    before it raises ValueError naming the file and the line, unless ``lenient`` (a restart reading the
    record to decide where to resume passes such lines over too). ``missing_ok``: no file gives []."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        if missing_ok:
            return []
        raise
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            if i == len(lines) or lenient:                 # (the last piece: no newline after it)
                continue
            raise ValueError(f"sample record {str(path)!r}, line {i}: not a JSON row ({e}): {line[:80]!r}"
                             ) from None
    return rows


def effective_rows(rows: Iterable[dict]) -> list[dict]:
    """Drop sample-record rows of steps that were rolled back and replayed after a restart.

    A step may be recorded by several generations (a fault loses the steps since the last checkpoint,
    which are then run again); only the latest generation's rows for each (epoch, step) count.
    Rows without a ``generation`` key are all kept.
    """
    rows = list(rows)
    latest: dict[int, object] = {}
    for r in rows:
        g = r.get("generation")
        if g is not None and (r["step"] not in latest or g > latest[r["step"]]):
            latest[r["step"]] = g
    return [r for r in rows if r.get("generation") is None or r["generation"] == latest[r["step"]]]


def recorded_through(rows: Iterable[dict]) -> int | None:
    """The last step of the record's newest generation through which every one of its ranks has rows (None:
    no row has a generation). A rank with no row there counts from the step before the generation's first:
    the one it resumed from. A restart from a checkpoint after this step would leave rows out of the record:
    those of a rank that died after the step's update but before it wrote them."""
    last: dict[int, dict[int, int]] = defaultdict(dict)  # generation -> rank -> its last step
    world: dict[int, int] = {}
    first: dict[int, int] = {}  # generation -> its first step
    for r in rows:
        g = r.get("generation")
        if g is None:
            continue
        rank, step = int(r["rank"]), int(r["step"])
        last[g][rank] = max(last[g].get(rank, step), step)
        world[g], first[g] = int(r["world_size"]), min(first.get(g, step), step)
    if not last:
        return None
    g = max(last)
    return min(last[g].get(rank, first[g] - 1) for rank in range(world[g]))


def check_exactly_once(rows: Iterable[dict], num_samples: int, epochs: int | None = None) -> dict:
    """Verify from a sample record that every index of each complete epoch was consumed exactly once.

    Returns ``{"epochs": {epoch: {"missing", "duplicates", "complete"}}, "ok", "world_sizes"}``. Without
    ``epochs`` the last epoch counts only if it is complete (no missing index) or another epoch follows it:
    a job stopped or cut by ``max_steps`` ends inside one. ``epochs``: the job ran to its end over that many
    epochs, so each of them must be there and complete, the last one too (a finished job whose record
    misses samples of its last epoch is not ``ok``).
    """
    per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    sizes = []
    last_step_size = None
    for r in sorted(effective_rows(rows), key=lambda r: (r["step"], r["rank"])):
        per_epoch[int(r["epoch"])].append(np.asarray(r["indices"], dtype=np.int64))
        if r["world_size"] != last_step_size:
            sizes.append(int(r["world_size"]))
            last_step_size = r["world_size"]
    report: dict = {"epochs": {}, "world_sizes": sizes}
    ok = True
    found = sorted(per_epoch)
    for e in sorted(set(found) | set(range(epochs or 0))):
        idx = np.concatenate(per_epoch[e]) if per_epoch.get(e) else np.zeros(0, np.int64)
        counts = np.bincount(idx, minlength=num_samples)
        missing = np.flatnonzero(counts == 0).tolist()
        dup = np.flatnonzero(counts > 1).tolist()
        may_be_short = epochs is None and e == found[-1]
        complete = not missing or not may_be_short
        report["epochs"][e] = {"missing": missing, "duplicates": dup, "complete": bool(complete)}
        ok = ok and not dup and (not missing or may_be_short)
    report["ok"] = ok
    return report
