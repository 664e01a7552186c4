#!/usr/bin/env bash
# The Triton kernels compiled for sm_90 by the Triton that the GPU machine runs (issue 14's device: torch
# 2.11.0+cu130, whose wheel pins triton 3.6.0), not only by .venv-cuda's (torch 2.14.1: Triton 3.8): a
# kernel that the newer compiler takes and the older one rejects would otherwise be found only on a GPU.
# Only the kernels the layers launch by default and the tuner's candidates (triton_aot.py --default-path).
# .venv-triton-gpu holds that Triton alone and reads torch from .venv-cuda (a .pth file): its own
# site-packages come first on sys.path, so `import triton` finds 3.6.0.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_GPU=${TRITON_GPU:-3.6.0}
V=.venv-triton-gpu
[ -x .venv-cuda/bin/python ] || { echo ".venv-cuda is missing: run .ci/cuda_build.sh first"; exit 1; }
if ! [ -f $V/.triton-$TRITON_GPU ]; then
  rm -rf $V
  python3 -m venv $V
  $V/bin/python -m pip install -q --no-deps "triton==$TRITON_GPU"
  site_cuda=$(.venv-cuda/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  site_own=$($V/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$(cd "$site_cuda" && pwd)" > "$site_own/venv_cuda.pth"
  touch $V/.triton-$TRITON_GPU
fi
$V/bin/python - <<PY
import triton, torch
assert triton.__version__ == "$TRITON_GPU", triton.__version__
print(f"Triton {triton.__version__} (the GPU machine's), torch {torch.__version__} from .venv-cuda")
PY
$V/bin/python .ci/triton_aot.py --default-path
