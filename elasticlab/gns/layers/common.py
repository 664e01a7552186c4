"""Helpers shared by the layer rules: batch-dimension checks, mixed-precision casts, and a call's keyword
arguments moved to their positions.

Under ``torch.autocast`` a layer's forward hook sees the input as the caller passed it (often float32) while
the gradient of its output arrives in the autocast dtype (bfloat16 or float16). Rules compute in one dtype:
matrix layers (Linear, Conv) in the dtype autocast ran them in (the output's), normalisation layers in the
wider of the two (autocast runs them in float32). Kernels accumulate in float32 either way and return
float32 norms for half-precision inputs.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable

import torch
from torch import nn

from elasticlab.gns import kernels


def batched(module: nn.Module, x: torch.Tensor, min_dim: int) -> None:
    """ValueError naming the module when ``x`` has fewer than ``min_dim`` dimensions (no batch dimension)."""
    if x.dim() < min_dim:
        raise ValueError(f"per-example norms need a batch dimension first: {type(module).__name__} got an "
                         f"input of shape {tuple(x.shape)}")


def positional_names(module: nn.Module) -> tuple[str, ...]:
    """The names of the parameters of ``module``'s own forward (its class's) that a caller may pass by
    position, in order (``('input',)`` for nn.Linear, ``('input', 'hx')`` for nn.LSTMCell)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in itertools.takewhile(lambda p: p.kind in kinds, params))


def by_position(names: tuple[str, ...], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's ``args`` and ``kwargs`` with the arguments passed by keyword that could have been passed by
    position (``lin(input=x)``; ``names``: :func:`positional_names`) moved into ``args``, up to the first
    not given: the rules and the fused forwards read a layer's inputs by position."""
    names = names[len(args):]
    if not names or names[0] not in kwargs:
        return args, kwargs
    kwargs = dict(kwargs)
    for n in names:
        if n not in kwargs:
            break
        args = (*args, kwargs.pop(n))
    return args, kwargs


def autocast_on(t: torch.Tensor) -> bool:
    """Whether autocast is on for ``t``'s device, without a device lookup in the common case (off)."""
    if ((t.is_cuda or t.is_cpu) and not torch.compiler.is_compiling()
            and not torch._C._is_any_autocast_enabled()):  # (that flag omits some backends, e.g. MPS)
        return False
    return torch.is_autocast_enabled(t.device.type)


def norm_layer_buffer(slot, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the slot's norm row, upcast) for a normalisation layer's C++ function: under autocast it computes in
    the wider of x's dtype and float32, as autocast runs the layer."""
    upcast = autocast_on(x)
    dt = torch.promote_types(x.dtype, torch.float32) if upcast else x.dtype
    return slot.buffer(x.shape[0], kernels.acc_dtype(dt), x.device), upcast


def as_autocast_gives(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A normalisation layer's output, computed in float32 under autocast, in the dtype autocast's own op
    gives it: float32 on CUDA (layer_norm and group_norm are on its float32 list), the input's on the CPU
    (whose autocast runs them in the input's dtype), so that the layers after it run as without
    PerSampleGradNorms."""
    if out.dtype != x.dtype and x.device.type == "cpu" and autocast_on(x):
        return out.to(x.dtype)
    return out


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype on ``t``'s device when autocast is on there and ``t`` is floating, else None."""
    if autocast_on(t) and t.is_floating_point():
        return torch.get_autocast_dtype(t.device.type)
    return None


def forward_autocast(t) -> tuple[str, torch.dtype | None] | None:
    """The autocast state of a call on ``t`` at its forward, to run it again as it ran (:func:`as_forward`):
    (device type, the autocast dtype or None where autocast is off there); None without a tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    return t.device.type, (torch.get_autocast_dtype(t.device.type) if autocast_on(t) else None)


def as_forward(state: tuple[str, torch.dtype | None] | None):
    """A context that sets autocast as :func:`forward_autocast` found it (a no-op for None)."""
    if state is None:
        return contextlib.nullcontext()
    device, dtype = state
    return torch.autocast(device, dtype=dtype, enabled=True) if dtype is not None else \
        torch.autocast(device, enabled=False)


class EagerUnderCompile:
    """A function run eagerly under torch.compile (a graph break where it is called); wrapped by
    :meth:`prepare` when a :class:`~elasticlab.gns.PerSampleGradNorms` is entered, not at import, which
    would load Dynamo."""
    every: list = []

    def __init__(self, fn: Callable):
        self.fn, self.eager = fn, None
        functools.update_wrapper(self, fn)
        EagerUnderCompile.every.append(self)

    def __call__(self, *args, **kwargs):
        if self.eager is not None and torch.compiler.is_compiling():
            return self.eager(*args, **kwargs)
        return self.fn(*args, **kwargs)

    @classmethod
    def prepare(cls) -> None:
        for f in cls.every:
            if f.eager is None:
                f.eager = torch.compiler.disable(f.fn)


def cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` in ``dtype`` (no copy when it already is; None passes through)."""
    if t is None or dtype is None or t.dtype == dtype:
        return t
    return t.to(dtype)


def wider(*ts: torch.Tensor) -> torch.dtype:
    """The promoted floating dtype of the tensors (float32 for a bfloat16/float32 mix)."""
    out = ts[0].dtype
    for t in ts[1:]:
        out = torch.promote_types(out, t.dtype)
    return out


def normalized_dims(module: nn.Module) -> int:
    """The trailing feature dimensions of a normalisation layer (its ``normalized_shape``)."""
    return len(module.normalized_shape)


def along_positions(norms: Callable, n_in: Callable[[nn.Module], int], n_out: Callable[[nn.Module], int]):
    """The ``summed`` form (:mod:`elasticlab.gns.repeated`) of a hook rule ``norms`` whose per-example
    gradient is a sum over positions: the calls' inputs (B, …, *F_in) and output gradients (B, …, *F_out),
    with n_in(module) and n_out(module) trailing feature dimensions, concatenated along the positions into
    one call. Exact by linearity: Σ_k Σ_t of the calls' terms is the one call's Σ_t."""
    def summed(module: nn.Module, calls, need) -> dict:
        B, fi, fo = calls[0][1].shape[0], n_in(module), n_out(module)
        xs = [x[0].reshape(B, -1, *x[0].shape[x[0].dim() - fi:]) for x, _ in calls]
        ds = [d.reshape(B, -1, *d.shape[d.dim() - fo:]) for _, d in calls]
        # (torch.cat promotes mixed dtypes: calls inside and outside an autocast region)
        return norms(module, (torch.cat(xs, 1), *calls[0][0][1:]), torch.cat(ds, 1), need)
    return summed


def affine_norms(gw: torch.Tensor, gb: torch.Tensor, need) -> dict:
    """{weight, bias: (B,) squared norms} of per-example affine-parameter gradients (B, …) of a norm layer."""
    out = {}
    if "weight" in need:
        out["weight"] = kernels.row_sq(gw)
    if "bias" in need:
        out["bias"] = kernels.row_sq(gb)
    return out
