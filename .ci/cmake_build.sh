#!/usr/bin/env bash
# Configure and build CMakeLists.txt against the libtorch of .venv (CPU), then run the C++ test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PREFIX=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build-cmake -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIX" \
      -DPython3_EXECUTABLE="$PWD/$PY" >/dev/null
cmake --build build-cmake -j2
(cd build-cmake && ctest --output-on-failure)
