"""Loading of the compiled extension ``elasticlab._C`` and the kernels it registered.

Kernels are torch operators (``torch.ops.elasticlab.*``). When ``_C`` is not built, callers use the
pure-PyTorch reference path; :func:`kernel` returns ``None`` and one warning says so.
"""
from __future__ import annotations

import math
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


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def conv_out_sizes(sizes, kernel, stride, padding, dilation) -> list[int]:
    """A convolution's output extent along each spatial dimension (the formula of ``torch.nn.Conv2d``'s
    documentation): what ``conv_patches`` computes in C++, for its fake and the Python forms."""
    dims = zip(sizes, kernel, stride, padding, dilation)
    return [(n + 2 * p - dl * (k - 1) - 1) // s + 1 for n, k, s, p, dl in dims]


def _register_fakes() -> None:
    """Fake (meta) implementations: output shapes and dtypes only, so that ``torch.compile`` and
    ``torch.export`` can trace through the operators without running them."""
    lib = "elasticlab::"

    @torch.library.register_fake(lib + "row_sq_norms")
    def _row_sq(x):
        return x.new_empty((x.shape[0],), dtype=_acc(x.dtype))

    @torch.library.register_fake(lib + "seq_linear_gram_norms")
    def _gram(a, d):
        return a.new_empty((a.shape[0],), dtype=_acc(a.dtype))

    @torch.library.register_fake(lib + "seq_linear_outer_norms")
    def _outer(a, d, with_grad):
        shape = (d.shape[2], a.shape[2]) if with_grad else (0,)
        return a.new_empty((a.shape[0],), dtype=_acc(a.dtype)), a.new_empty(shape, dtype=_acc(a.dtype))

    @torch.library.register_fake(lib + "conv_patches")
    def _patches(x, kernel, stride, padding, dilation):
        out = conv_out_sizes(x.shape[2:], kernel, stride, padding, dilation)
        return x.new_empty((x.shape[0], math.prod(out), x.shape[1] * math.prod(kernel)))

    @torch.library.register_fake(lib + "layernorm_per_example")
    def _layernorm(x, d, mean, rstd):
        shape = (x.shape[0], x.shape[2])
        return x.new_empty(shape, dtype=_acc(x.dtype)), x.new_empty(shape, dtype=_acc(x.dtype))


if HAS_C:
    _register_fakes()


def set_tf32_mode(mode: int) -> int | None:
    """``_C``'s per-thread TF32 mode for float32 per-example GEMMs (-1: torch's matmul setting, 0: off, 1: on;
    ``tf32_mode`` in csrc/ops.h) set; returns the previous mode, or None when ``_C`` (or a build with this
    setting) is absent."""
    setter = getattr(_C, "set_tf32_mode", None) if HAS_C else None
    return None if setter is None else setter(mode)


def set_scratch_bytes(n: int) -> int | None:
    """``_C``'s scratch budget per chunk of examples of its CUDA forms (bytes, ``scratch_bytes`` in
    csrc/ops.h) set; returns the previous budget, or None when ``_C`` (or a build with this setting) is
    absent."""
    setter = getattr(_C, "set_scratch_bytes", None) if HAS_C else None
    return None if setter is None else setter(int(n))


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


_HAS_KERNEL: dict[tuple[str, str], bool] = {}     # a plain dict, not functools.cache: torch.compile traces it


def has_kernel(name: str, device_type: str) -> bool:
    """Whether operator ``elasticlab::name`` has a kernel for ``device_type`` ("cpu" or "cuda")."""
    hit = _HAS_KERNEL.get((name, device_type))
    if hit is not None:
        return hit
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    ok = False
    if HAS_C and key is not None:
        try:
            ok = torch._C._dispatch_has_kernel_for_dispatch_key(f"elasticlab::{name}", key)
        except RuntimeError:  # an operator this build of _C does not define (e.g. an older build)
            ok = False
    _HAS_KERNEL[(name, device_type)] = ok
    return ok


def _known_kernels() -> None:
    """Fills :func:`has_kernel`'s answers for every operator of ``_C`` at import: a traced call
    (``torch.compile``) then reads a dict, where the dispatcher query, which returns no tensor, would break
    the graph."""
    for name in operators():
        for dev in ("cpu", "cuda"):
            has_kernel(name, dev)


if HAS_C:
    _known_kernels()


def direct_call(name: str):
    """``_C.<name>``, the direct call of a fused layer's operator (csrc/bindings.cpp: the same positional
    arguments as ``torch.ops.elasticlab.<name>``, without torch.ops' boxed Python entry), or None when this
    build of ``_C`` has none."""
    return getattr(_C, name, None) if HAS_C else None


def kernel(name: str, device_type: str):
    """The operator ``torch.ops.elasticlab.name`` if it has a kernel for the device, else ``None``
    (warning once when the whole extension is missing)."""
    if not HAS_C:
        _warn_once()
        return None
    if not has_kernel(name, device_type):
        return None
    return getattr(torch.ops.elasticlab, name)
