"""Where this package's Triton kernels run and how they are launched: shared by the outer-product
(:mod:`~elasticlab.gns.triton_outer`), Gram (:mod:`~elasticlab.gns.triton_gram`) and convolution
(:mod:`~elasticlab.gns.triton_conv`) kernels.

Triton ships with CUDA builds of torch; without it (a CPU build) :data:`HAS_TRITON` is False and every
Triton path is left out. Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set before Triton is imported: :data:`INTERPRETED`), on CPU tensors, which is how CI tests them.
"""
from __future__ import annotations

import os

import torch

try:  # pragma: no cover - depends on the torch build
    import triton  # noqa: F401  (imported here first: whether it is there)

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False
try:  # pragma: no cover - Triton 3.4 and later
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (the TMA kernels' operands)

    HAS_TMA = HAS_TRITON
except ImportError:  # pragma: no cover
    HAS_TMA = False

# Triton's CPU interpreter (set before Triton is imported): the kernels run on CPU tensors, without bfloat16.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_PROPS: dict[int, object] = {}                     # CUDA device index -> torch.cuda.get_device_properties


def kernel_device() -> str | None:
    """Where this package's Triton kernels can run now: "cpu" under the interpreter (:data:`INTERPRETED`),
    "cuda" with Triton and a GPU, else None (what their tests skip on)."""
    if not HAS_TRITON:
        return None
    return "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)


def kernel_dtypes() -> list[torch.dtype]:
    """The input dtypes the kernels take on :func:`kernel_device`: float16 and float32, and bfloat16 on a GPU
    (the interpreter computes in numpy, which has no bfloat16)."""
    return [torch.float16, torch.float32] + ([] if INTERPRETED else [torch.bfloat16])


def props(dev: torch.device):
    """``dev``'s CUDA device properties, read once per device."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    p = _PROPS.get(idx)
    if p is None:
        p = _PROPS[idx] = torch.cuda.get_device_properties(idx)
    return p


def sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of ``dev``; 4 for a CPU tensor (Triton's interpreter, ``TRITON_INTERPRET=1``,
    where tests run the kernels without a GPU and this count only sets how the examples are split)."""
    return props(dev).multi_processor_count if dev.type == "cuda" else 4


# Programs per SM that :func:`splits` aims for. The default 16-bit 128×128 tiles (4 stages: 128 KB of shared
# memory) and the tuner's 128×256 tile fit one program per SM, so a second is a second wave: on G3's 1024→4096
# layer in the wide tile (128 tiles on 132 SMs) two per SM split the examples in two, for no more programs at
# once, at the price of a second 16 MB gradient slice and its sum. Untimed: bench_seq_linear_cuda.py's sweep
# times 1 against 2 (lines ``per-sm-1``, ``per-sm-2``).
PROGRAMS_PER_SM = 2


def splits(B: int, tiles: int, dev: torch.device, per_sm: int | None = None) -> int:
    """How many groups the B examples are split into over the grid's second axis: enough programs for
    ``per_sm`` (default :data:`PROGRAMS_PER_SM`) per SM."""
    return max(1, min(B, ((per_sm or PROGRAMS_PER_SM) * sm_count(dev)) // tiles))


def precision(dtype: torch.dtype, tf32: bool | None = None) -> str:
    """``tl.dot``'s input precision: for float32, exact unless TF32 is allowed (``tf32``; None: torch's matmul
    setting, as a Linear's own GEMM runs); half-precision operands multiply exactly on tensor cores either
    way."""
    if dtype == torch.float32 and not (torch.backends.cuda.matmul.allow_tf32 if tf32 is None else tf32):
        return "ieee"
    return "tf32"


def launch(kernel, grid: tuple, device: torch.device, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)`` on ``device``'s CUDA context when that is not the current one (a CPU
    device under the interpreter: as is)."""
    if device.index is None or device.index == torch.cuda.current_device():
        kernel[grid](*args, **meta)
    else:
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)


def run_tiles(kernel, a: torch.Tensor, d: torch.Tensor, scalars: tuple, tiles: int, rows: int, cols: int,
              with_grad: bool, meta: dict, operands: tuple | None = None, rows_per_tile: int = 1,
              outputs: tuple = ()):
    """Launches a fused per-example-norm kernel ``kernel(a, d, partial, grad, *outputs, *scalars, SPLIT,
    **meta)`` on a (tiles, split) grid, the B examples of ``a`` split over enough programs for two per SM
    (:func:`splits`), and returns (‖G_b‖² (B,) float32, the (rows, cols) float32 gradient or None): the
    partial norms (B, tiles × ``rows_per_tile``) summed over tiles, the splits' gradient slices over splits
    (both deterministic). ``operands``: what the kernel takes in place of (a, d), e.g. TMA descriptors over
    them; ``outputs``: further buffers it writes (None: a placeholder it does not touch)."""
    B = a.shape[0]
    split = splits(B, tiles, a.device)
    partial = torch.empty(B, tiles * rows_per_tile, device=a.device, dtype=torch.float32)
    # norms only: the kernel never touches grad_ptr (WITH_GRAD is a compile-time constant), so it gets the
    # partial buffer as a placeholder
    grad = torch.empty(split, rows, cols, device=a.device, dtype=torch.float32) if with_grad else partial
    extra = tuple(partial if t is None else t for t in outputs)
    launch(kernel, (tiles, split), a.device, (*(operands or (a, d)), partial, grad, *extra, *scalars, split),
           meta)
    norms = partial.sum(1)
    if not with_grad:
        return norms, None
    return norms, (grad[0] if split == 1 else grad.sum(0))
