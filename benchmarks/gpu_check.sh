#!/usr/bin/env bash
# GPU check of issue 9, run from the repository root on a CUDA machine (no pip installs, no internet):
#   OUT=/some/dir bash benchmarks/gpu_check.sh
# 1. builds elasticlab._C in place with the CUDA kernels (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16),
# 2. runs the gpu-marked tests (kernels vs the CPU reference in float64 and float32, each kernel),
# 3. runs benchmarks/bench_psgnorm.py --device cuda.
# Logs go to $OUT; it stops at the first failing stage (each stage has its own timeout; ~6 min in all).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} ELASTICLAB_CUDA=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# cuBLAS/cuSPARSE headers carried by torch's nvidia wheels, when present.
NV=$($PY -c 'import site,os;print(next((p for p in (os.path.join(s,"nvidia","cu13","include") for s in site.getsitepackages()) if os.path.isdir(p)),""))' 2>/dev/null)
[ -n "$NV" ] && export CPATH="$NV${CPATH:+:$CPATH}"
stage() { echo "== $1 ($(date -u +%T))" | tee -a "$OUT/summary.txt"; }
fail() { echo "FAILED: $1 (see $OUT/$2)" | tee -a "$OUT/summary.txt"; tail -40 "$OUT/$2"; exit 1; }

stage "environment"
{ nvidia-smi; $PY -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'; nvcc --version; } \
  > "$OUT/env.txt" 2>&1 || fail "environment" env.txt
tail -1 "$OUT/env.txt"

stage "build elasticlab._C with CUDA kernels"
rm -f elasticlab/_C*.so
timeout 330 $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || fail "build" build.log
$PY -m elasticlab info > "$OUT/info.txt" 2>&1 || fail "import" info.txt
grep -E "kernels_cuda|gpu" "$OUT/info.txt" | tee -a "$OUT/summary.txt"

stage "pytest -m gpu (this issue's kernels)"
timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests/test_psgnorm_kernels.py tests/test_foundation.py \
  > "$OUT/pytest_gpu_kernels.log" 2>&1 || fail "gpu tests" pytest_gpu_kernels.log
tail -2 "$OUT/pytest_gpu_kernels.log" | tee -a "$OUT/summary.txt"
stage "pytest -m gpu tests/ (all; other files' collection errors reported, not fatal)"
timeout 120 $PY -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests/ \
  > "$OUT/pytest_gpu.log" 2>&1
echo "rc=$? $(tail -1 "$OUT/pytest_gpu.log")" | tee -a "$OUT/summary.txt"

stage "bench_psgnorm --device cuda"
timeout 240 $PY benchmarks/bench_psgnorm.py --device cuda --threads 16 > "$OUT/bench_cuda.log" 2>&1 \
  || fail "benchmark" bench_cuda.log
grep -v "^RESULT" "$OUT/bench_cuda.log" | grep -v "it/s\]" | tee -a "$OUT/summary.txt"
grep "^RESULT" "$OUT/bench_cuda.log" > "$OUT/result.json.txt"
stage "done"
