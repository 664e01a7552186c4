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
# The CMake-built module loads (its operators are elasticlab::*, so in a fresh process apart from the package's
# own _C) and its direct call runs a fused Linear forward and backward.
(cd build-cmake && "../$PY" - <<'PYEOF'
import importlib.util

import torch

spec = importlib.util.spec_from_file_location("_C", "_C.so")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
x, w, norms = torch.randn(4, 3), torch.randn(2, 3, requires_grad=True), torch.zeros(2, 4)
y = mod.linear_norms(x, w, None, norms, 0, None)
y.pow(2).sum().backward()
g = 2 * y.detach()
torch.testing.assert_close(norms[0], x.pow(2).sum(1) * g.pow(2).sum(1))
print("CMake-built _C: direct call ok")
PYEOF
)
