"""Atomic, checksummed checkpoints with fallback to the previous one.

File layout: a magic line, the SHA-256 of the payload, then the payload (``torch.save`` bytes).
Writes go to a temporary file in the same directory, are fsync'ed, then ``os.replace``'d into place
(and the directory fsync'ed), so a reader never sees a half-written file under the final name; a
file damaged later (truncated, bit-flipped) fails its checksum and :meth:`CheckpointDir.latest`
falls back to the previous one. Loading always uses ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from pathlib import Path

MAGIC = b"ELASTICLAB-CKPT-1\n"
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or fails its checksum."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(state: dict, path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` atomically (temp file + fsync + os.replace) with a checksum."""
    import torch

    path = Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).hexdigest().encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + digest + b"\n" + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def verify(path: str | os.PathLike) -> bytes:
    """Return the payload of ``path`` if its checksum holds, else raise :class:`CheckpointError`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    head = len(MAGIC) + 65
    if len(data) < head or not data.startswith(MAGIC) or data[head - 1:head] != b"\n":
        raise CheckpointError(f"checkpoint {path} is truncated or not an elasticlab checkpoint")
    digest, payload = data[len(MAGIC):head - 1], data[head:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint {path} fails its SHA-256 checksum (truncated or corrupt)")
    return payload


def load(path: str | os.PathLike) -> dict:
    """Verify and load a checkpoint with ``torch.load(weights_only=True)``.

    A payload that passes its checksum but that ``weights_only=True`` refuses (a pickle of arbitrary
    objects) or that is not a torch file raises :class:`CheckpointError` too: the caller treats it as
    a corrupt checkpoint."""
    import torch

    payload = verify(path)
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as e:  # UnpicklingError (weights_only refused), RuntimeError (not a torch file)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"checkpoint {path} does not load with weights_only=True: "
                              f"{type(e).__name__}: {first}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a state dict")
    return state


class CheckpointDir:
    """A directory of numbered checkpoints ``ckpt-<step>.pt``, keeping the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):       # the path, or a folder above it, is a file
            raise ValueError(f"checkpoint folder {str(directory)!r} cannot be made: it, or a folder above "
                             "it, is a file") from None
        self.keep = int(keep)

    def path(self, step: int) -> Path:
        return self.directory / f"ckpt-{int(step):09d}.pt"

    def steps(self) -> list[int]:
        """Steps that have a checkpoint file, oldest first (unverified)."""
        out = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def save(self, state: dict, step: int) -> Path:
        p = save(state, self.path(step))
        for old in self.steps()[:-self.keep]:
            try:
                self.path(old).unlink()
            except FileNotFoundError:
                pass
        return p

    def latest(self, exclude=(), at_most: int | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest checkpoint that verifies, and the (path, reason) of newer ones that did not.

        Paths in ``exclude`` (checkpoints found unloadable before) are passed over without a reason; with
        ``at_most``, so are the checkpoints of later steps."""
        bad = []
        skip = {str(p) for p in exclude}
        for step in reversed(self.steps()):
            p = self.path(step)
            if str(p) in skip or (at_most is not None and step > at_most):
                continue
            try:
                verify(p)
            except CheckpointError as e:
                bad.append((p, str(e)))
                continue
            return p, bad
        return None, bad

    def latest_recorded(self, through: int | None, exclude=()) -> tuple[Path | None, list, bool]:
        """:meth:`latest` at or before ``through``, the last step whose sample rows every rank has in the
        record (None: no bound), and ``gap``: True where none is left there and the newest is returned
        instead (a restart there leaves the record without some rank's rows)."""
        path, bad = self.latest(exclude, at_most=through)
        if path is not None or through is None:
            return path, bad, False
        path, bad = self.latest(exclude)
        return path, bad, path is not None
