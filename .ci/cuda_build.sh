#!/usr/bin/env bash
# Compile and link elasticlab._C with its CUDA kernels in a second venv (.venv-cuda, torch 2.14.1+cu130),
# import it and run a CPU operator (no GPU here). The build goes to build-cuda/, not the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"8.0;9.0+PTX"}
export MAX_JOBS=${MAX_JOBS:-2}
command -v nvcc >/dev/null || { echo "nvcc not found under $CUDA_HOME"; exit 1; }
V=.venv-cuda
if ! [ -f $V/.torch-2.14.1 ]; then
  python3 -m venv $V
  $V/bin/python -m pip install -q --upgrade pip setuptools wheel ninja
  $V/bin/python -m pip install -q torch==2.14.1 numpy
  touch $V/.torch-2.14.1
fi
NV=$($V/bin/python -c 'import site,os;print(next(p for p in (os.path.join(s,"nvidia","cu13","include") for s in site.getsitepackages()) if os.path.isdir(p)))')
export CPATH="$NV${CPATH:+:$CPATH}"
ELASTICLAB_CUDA=1 $V/bin/python setup.py -q build_ext --build-temp build-cuda/tmp --build-lib build-cuda/lib
# Put the built module beside the package's loader and check it there.
mkdir -p build-cuda/lib/elasticlab
cp elasticlab/__init__.py elasticlab/_ext.py build-cuda/lib/elasticlab/
cd build-cuda/lib
../../$V/bin/python - <<'PY'
import torch
from elasticlab import _ext
assert _ext.HAS_C, "elasticlab._C (CUDA build) did not import"
assert not torch.cuda.is_available()
ops = _ext.operators()
missing = [o for o in ops if not _ext.has_kernel(o, "cuda")]
x = torch.randn(4, 5, dtype=torch.float64)
torch.testing.assert_close(torch.ops.elasticlab.row_sq_norms(x), x.pow(2).sum(1))
print(f"CUDA build ok: torch {torch.__version__}; operators {ops}; without a CUDA kernel: {missing or 'none'}")
PY
