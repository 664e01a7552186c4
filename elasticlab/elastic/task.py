"""What a job trains: a :class:`Task`, built in every worker by an importable entrypoint.

An entrypoint is ``"package.module:function"``, ``"path/to/script.py:function"`` (default function
``make_task``), or a module-level function object (sent to workers by its qualified name — functions
defined in a notebook cell cannot be imported by spawned workers, so they are refused).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def classification_loss(model, batch):
    """Mean cross-entropy of ``model(x)`` against ``y`` for a batch ``(x, y)``."""
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(model(x), y)


@dataclass
class Task:
    """A model, its data and how to train it.

    ``dataset`` is indexable with ``len()``; a tuple of equally long tensors (or a ``TensorDataset``)
    is indexed in one go, anything else is collated with ``torch.utils.data.default_collate``.
    ``optimizer`` builds the optimizer from the parameters at the base LR ``lr`` (for ``base_batch``).
    """

    model: Any
    dataset: Any
    optimizer: Callable[..., Any]
    loss_fn: Callable[[Any, Any], Any] = classification_loss
    base_batch: int = 32
    probe_size: int = 64

    def __post_init__(self):
        if len(self) < 1:
            raise ValueError("the task's dataset is empty")
        if self.base_batch < 1:
            raise ValueError(f"base_batch must be >= 1, got {self.base_batch!r}")

    def __len__(self) -> int:
        d = self.dataset
        if isinstance(d, tuple):
            return len(d[0])
        return len(d)

    def batch(self, indices):
        """Gather the samples ``indices`` into one batch."""
        import torch

        idx = torch.as_tensor(indices, dtype=torch.long)
        d = self.dataset
        tensors = d if isinstance(d, tuple) else getattr(d, "tensors", None)
        if tensors is not None:
            return tuple(t[idx] for t in tensors)
        return torch.utils.data.default_collate([d[int(i)] for i in idx])


def entrypoint_name(entrypoint) -> str:
    """Normalise an entrypoint to the ``"module_or_path:function"`` string workers import."""
    if isinstance(entrypoint, str):
        mod, _, fn = entrypoint.partition(":")
        if not mod:
            raise ValueError(f"entrypoint {entrypoint!r} names no module or script")
        if mod.endswith(".py"):
            if not os.path.isfile(mod):
                raise ValueError(f"entrypoint script {mod!r} does not exist")
            mod = os.path.abspath(mod)
        return f"{mod}:{fn or 'make_task'}"
    if callable(entrypoint):
        mod, qual = getattr(entrypoint, "__module__", None), getattr(entrypoint, "__qualname__", "")
        if mod in (None, "__main__") or "<locals>" in qual or "." in qual:
            raise ValueError(
                f"entrypoint {entrypoint!r} is not importable by worker processes (defined in a notebook "
                "cell, __main__ or a local scope); put it in a module and pass it or 'module:function'")
        return f"{mod}:{qual}"
    raise ValueError(f"entrypoint must be 'module:function', 'script.py:function' or a function, "
                     f"got {entrypoint!r}")


class EntrypointError(ValueError):
    """An entrypoint that names no task function (or whose function returns no :class:`Task`): the message
    names the bad value, so a worker reports it without a traceback."""


def resolve(entrypoint) -> Callable[..., Task]:
    """Import the function an entrypoint names."""
    mod, _, fn = entrypoint_name(entrypoint).partition(":")
    if mod.endswith(".py"):
        name = "_elasticlab_entry_" + os.path.splitext(os.path.basename(mod))[0]
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, mod)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        module = sys.modules[name]
    else:
        module = importlib.import_module(mod)
    try:
        return getattr(module, fn)
    except AttributeError:
        raise EntrypointError(f"entrypoint module {mod!r} has no function {fn!r}") from None


def build(entrypoint, kwargs: dict | None = None) -> Task:
    task = resolve(entrypoint)(**(kwargs or {}))
    if not isinstance(task, Task):
        raise EntrypointError(f"entrypoint {entrypoint_name(entrypoint)} returned {type(task).__name__}, "
                              "not Task")
    return task
