"""Loading of the compiled extension ``elasticlab._C`` and the kernels it registered.

Kernels are torch operators (``torch.ops.elasticlab.*``). When ``_C`` is not built, callers use the
pure-PyTorch reference path; :func:`kernel` returns ``None`` and one warning says so.
"""
from __future__ import annotations

import functools
import warnings

import torch

try:
    from elasticlab import _C  # noqa: F401  (loading registers the operators)

    HAS_C = True
    _IMPORT_ERROR: Exception | None = None
except ImportError as e:  # pragma: no cover - depends on the build
    HAS_C = False
    _IMPORT_ERROR = e

_warned = False


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"elasticlab._C is not built ({_IMPORT_ERROR}); using the pure-PyTorch reference path. "
            "Build it with: pip install --no-build-isolation -e .",
            RuntimeWarning,
            stacklevel=3,
        )


def operators() -> list[str]:
    """Names of the operators ``_C`` registered (empty without ``_C``)."""
    if not HAS_C:
        return []
    return sorted(
        n.split("::", 1)[1]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("elasticlab::")
    )


@functools.cache
def has_kernel(name: str, device_type: str) -> bool:
    """Whether operator ``elasticlab::name`` has a kernel for ``device_type`` ("cpu" or "cuda")."""
    if not HAS_C:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"elasticlab::{name}", key)
    except RuntimeError:  # an operator this build of _C does not define (e.g. an older build)
        return False


def kernel(name: str, device_type: str):
    """The operator ``torch.ops.elasticlab.name`` if it has a kernel for the device, else ``None``
    (warning once when the whole extension is missing)."""
    if not HAS_C:
        _warn_once()
        return None
    if not has_kernel(name, device_type):
        return None
    return getattr(torch.ops.elasticlab, name)
