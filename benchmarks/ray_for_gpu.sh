#!/usr/bin/env bash
# Packs Ray for the bare GPU machine (no package index there; a call carries at most 64 MiB, Ray's wheel is
# ~79 MB): .whl/ray/ gets Ray's cp312 wheel unpacked without ray/jars (Java) and the dashboard's web client,
# as ray-stripped.tar.xz (~30 MB), and the wheels of its dependencies. benchmarks/gpu_check.sh's "ray"
# stage unpacks them to /tmp/ray-site. Run where pip reaches an index:  bash benchmarks/ray_for_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VER=${RAY_VERSION:-$($PY -c 'import ray; print(ray.__version__)')}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
$PY -m pip download -q "ray==$VER" --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$TMP/w"
mkdir -p "$TMP/x" .whl/ray
rm -f .whl/ray/*
(cd "$TMP/x" && unzip -q "$TMP"/w/ray-"$VER"-*.whl && rm -rf ray/jars ray/dashboard/client/build \
  && tar -cf - ray ray-"$VER".dist-info | xz -T0 -6 > "$OLDPWD/.whl/ray/ray-stripped.tar.xz")
find "$TMP/w" -name '*.whl' ! -name 'ray-*' -exec cp {} .whl/ray/ \;
du -sh .whl/ray
