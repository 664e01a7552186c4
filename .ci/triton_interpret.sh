#!/usr/bin/env bash
# The Triton kernels (elasticlab/gns/triton_outer.py: sequence Linear; triton_conv.py: convolutions) run by
# Triton's CPU interpreter, in the venv of the CUDA torch build that ships Triton (.venv-cuda, made by
# .ci/cuda_build.sh): no GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-cuda
[ -x $V/bin/python ] || { echo "$V is missing: run .ci/cuda_build.sh first"; exit 1; }
$V/bin/python -c 'import pytest, pytest_timeout, hypothesis' 2>/dev/null || $V/bin/python -m pip install -q pytest pytest-timeout hypothesis
# The source tree's _C is built for the CPU torch of .venv: this venv must not load it (elasticlab then
# falls back to its PyTorch kernels; the test compares the Triton kernel with the float64 reference).
export TRITON_INTERPRET=1
$V/bin/python -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" tests/gns/test_triton_outer.py tests/gns/test_triton_tune.py tests/gns/test_triton_gram.py \
  tests/gns/test_triton_conv.py \
  tests/gns/test_gpu_bench_forms.py
