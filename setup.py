"""Build elasticlab._C: C++ (OpenMP) kernels always, CUDA kernels when torch and nvcc support CUDA.

Needs torch installed first: ``pip install --no-build-isolation -e .``.
Environment: ELASTICLAB_CUDA=0 forces a CPU-only build, ELASTICLAB_CUDA=1 requires CUDA.
"""
import glob
import os
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - explained to the user
    sys.exit("elasticlab's extension needs torch installed first: pip install torch==2.13.0, "
             "then pip install --no-build-isolation -e .")

HERE = os.path.dirname(os.path.abspath(__file__))


def _rel(paths):
    return sorted(os.path.relpath(p, HERE) for p in paths)


def _want_cuda() -> bool:
    flag = os.environ.get("ELASTICLAB_CUDA", "auto")
    can = torch.version.cuda is not None and CUDA_HOME is not None
    if flag == "0":
        return False
    if flag == "1" and not can:
        sys.exit(f"ELASTICLAB_CUDA=1 but torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={CUDA_HOME!r}")
    return can


def extension():
    cpu_sources = _rel(glob.glob(os.path.join(HERE, "csrc", "*.cpp")) +
                       glob.glob(os.path.join(HERE, "csrc", "cpu", "*.cpp")) +
                       glob.glob(os.path.join(HERE, "csrc", "autograd", "*.cpp")))
    cxx = ["-O3", "-fopenmp"]
    kwargs = dict(name="elasticlab._C", extra_link_args=["-fopenmp"],
                  include_dirs=[os.path.join(HERE, "csrc")])
    if _want_cuda():
        cuda_sources = _rel(glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu")) +
                            glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cpp")))
        # cuBLAS/cuSPARSE headers shipped inside torch's nvidia wheels (CUDA 13 layout).
        import site
        for sp in site.getsitepackages():
            inc = os.path.join(sp, "nvidia", "cu13", "include")
            if os.path.isdir(inc):
                kwargs["include_dirs"].append(inc)
        nvcc = ["-O3", "--use_fast_math", "-lineinfo", "-diag-suppress", "3189"]
        return CUDAExtension(sources=cpu_sources + cuda_sources,
                             extra_compile_args={"cxx": cxx + ["-DELASTICLAB_WITH_CUDA"],
                                                 "nvcc": nvcc + ["-DELASTICLAB_WITH_CUDA"]},
                             **kwargs)
    return CppExtension(sources=cpu_sources, extra_compile_args={"cxx": cxx}, **kwargs)


# ELASTICLAB_NO_EXT=1 installs the Python package alone (the Makefile then builds _C in place, incrementally).
_ext_modules = [] if os.environ.get("ELASTICLAB_NO_EXT") == "1" else [extension()]
setup(ext_modules=_ext_modules, cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
