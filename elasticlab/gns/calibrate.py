"""Per-layer choice of the norm form by timing the candidates once per shape, on the device that runs them.

The static choices (:func:`elasticlab.gns.form_choice.use_gram`'s cost model, the Triton shape rule and the
switches of :mod:`~elasticlab.gns.triton_outer` and :mod:`~elasticlab.gns.layers.conv`) were set from one
H100's measurements. With :data:`ENABLED` on (as ``torch.backends.cudnn.benchmark`` does for convolution
algorithms), the first backward of each layer shape instead runs every form that serves it on the layer's own
inputs and output gradient: each once to warm up (Triton compiles there), then :data:`REPEATS` times between
CUDA events (the wall clock on the CPU), and remembers the fastest for that shape. The layer keeps the
fastest form's result for this step; later forwards route it to that form (the C++ autograd function for the
compiled forms, the rule's Python one for the Triton kernels). Only the first step of each shape pays, about
(1 + REPEATS) weight-gradient GEMMs per form; :func:`timings` lists what was measured.

A form's result is (per-example squared norms (B,), weight gradient), so every candidate is interchangeable;
one that raises (say, a Triton tile too large for the device's shared memory) is left out of the choice, with
a warning. Memory counts as well as time (issue 14's target: at most 10% more peak memory than plain): given
the forms' modelled scratch, a form whose scratch exceeds :func:`elasticlab.gns.form_choice.scratch_limit`
(the default path's memory rule) is not run at all, unless every form does (then the one with the least
scratch); :func:`left_out` lists what was so left out.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from elasticlab.gns import form_choice, timing

ENABLED = False
REPEATS = 3

_CHOSEN: dict[tuple, str] = {}
_TIMES: dict[tuple, dict[str, float]] = {}
_LEFT_OUT: dict[tuple, dict[str, int]] = {}


def active() -> bool:
    """Whether backwards measure and follow the choice now: :data:`ENABLED`, and eager (under
    ``torch.compile`` a backward is traced, not run: it keeps the static choice)."""
    return ENABLED and not torch.compiler.is_compiling()


def key_of(kind: str, *parts) -> tuple:
    """A layer shape's key: its kind ("linear", "conv") and whatever else fixes the forms' costs."""
    return (kind, *parts)


def chosen(key: tuple) -> str | None:
    """The form measured fastest for ``key``; None before its first backward, or with :data:`ENABLED` off."""
    return _CHOSEN.get(key) if ENABLED else None


def choose(key: tuple, forms: dict[str, Callable[[], tuple]], device: torch.device) -> tuple[str, tuple]:
    """Times each of ``forms`` (name → call returning the form's result), records the fastest for ``key`` and
    returns (its name, its result). A form that raises is left out, with a RuntimeWarning naming it and its
    error; if all raise, the last error propagates."""
    best_name, best_out, times = timing.fastest(forms, device, REPEATS,
                                                f"calibrate: forms left out of the choice for {key}",
                                                desc=f"calibrate {key[0]} "
                                                + "x".join(str(p) for p in key[1:] if isinstance(p, int)))
    _CHOSEN[key], _TIMES[key] = best_name, times
    return best_name, best_out


def within_memory(key: tuple, forms: dict[str, Callable[[], tuple]], scratch: dict[str, int] | None,
                  device: torch.device) -> dict[str, Callable[[], tuple]]:
    """``forms`` less those whose ``scratch`` (bytes, modelled; a form not named takes none) exceeds
    :func:`elasticlab.gns.form_choice.scratch_limit` on ``device``; if that leaves none, the one with the
    least scratch. What it drops is recorded for :func:`left_out`."""
    limit = form_choice.scratch_limit(device) if scratch else None
    if limit is None:
        return forms
    kept = {n: f for n, f in forms.items() if scratch.get(n, 0) <= limit}
    if not kept:
        least = min(forms, key=lambda n: scratch.get(n, 0))
        kept = {least: forms[least]}
    dropped = {n: int(scratch[n]) for n in forms if n not in kept}
    if dropped:
        _LEFT_OUT[key] = dropped
    return kept


def run(key: tuple, forms: dict[str, Callable[[], tuple]], device: torch.device,
        scratch: dict[str, int] | None = None) -> tuple:
    """The result of the form measured fastest for ``key``: the remembered one, or on the first call the
    fastest of :func:`choose`'s measurements (whose result it keeps) among the forms :func:`within_memory`
    keeps for their ``scratch`` (bytes per form, modelled)."""
    name = chosen(key)
    if name in forms:
        return forms[name]()
    return choose(key, within_memory(key, forms, scratch, device), device)[1]


def timings() -> dict[tuple, dict[str, float]]:
    """{layer key: {form: seconds}} of every shape calibrated so far (the chosen form is the fastest)."""
    return {k: dict(v) for k, v in _TIMES.items()}


def left_out() -> dict[tuple, dict[str, int]]:
    """{layer key: {form: modelled scratch bytes}} of the forms :func:`within_memory` kept out of a choice."""
    return {k: dict(v) for k, v in _LEFT_OUT.items()}


def kept() -> dict[tuple, str]:
    """{layer key: form} of every shape chosen so far, :data:`ENABLED` or not (what
    :mod:`elasticlab.gns.choices` saves)."""
    return dict(_CHOSEN)


def keep(key: tuple, form: str, times: dict[str, float]) -> None:
    """Takes ``form`` for ``key`` as if measured (``times``): with :data:`ENABLED`, later backwards of that
    shape run it without timing (what :mod:`elasticlab.gns.choices` loads)."""
    _CHOSEN[key], _TIMES[key] = form, dict(times)


def reset() -> None:
    """Forgets every choice: the next backward of each shape measures again."""
    _CHOSEN.clear()
    _TIMES.clear()
    _LEFT_OUT.clear()
