"""``elasticlab info``: versions, the compiled extension and its kernels, thread counts."""
from __future__ import annotations

import os
import platform

NAME = "info"
HELP = "print versions, whether elasticlab._C is built, its kernels (CPU, CUDA) and thread counts"


def add_arguments(parser) -> None:
    pass


def collect() -> dict:
    import numpy
    import torch

    import elasticlab
    from elasticlab import _ext

    ops = _ext.operators()
    info = {
        "elasticlab": elasticlab.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "cuda_available": torch.cuda.is_available(),
        "extension_built": _ext.HAS_C,
        "kernels_cpu": [o for o in ops if _ext.has_kernel(o, "cpu")],
        "kernels_cuda": [o for o in ops if _ext.has_kernel(o, "cuda")],
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "openmp": torch.backends.openmp.is_available(),
    }
    try:
        import numba

        info["numba"] = numba.__version__
        info["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    except ImportError:  # pragma: no cover
        info["numba"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run(args) -> int:
    for k, v in collect().items():
        if isinstance(v, list):
            v = ", ".join(v) if v else "(none)"
        print(f"{k:22s} {v}")
    return 0
