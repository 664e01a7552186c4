#!/usr/bin/env bash
# GPU check of the per-example gradient norms, run on a CUDA machine (no pip index, no internet needed):
#   OUT=/some/dir [STAGES="env build test bench profile"] bash benchmarks/gpu_check.sh
# Stages (each under its own timeout, all within DEADLINE_S, default 530 s; ~4-5 min on an H100):
#   env      nvidia-smi and versions -> env.txt
#   build    elasticlab._C with the CUDA kernels (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16; ~30 s) -> build.log;
#            when .before/ holds an earlier tree (carried; git archive of a past commit), it is built beside it
#   ops      benchmarks/bench_seq_linear_cuda.py: the sequence-Linear operators against the weight-gradient
#            GEMM, and the GEMM/bandwidth ceilings of the CUDA cost model; benchmarks/bench_conv_cuda.py: the
#            convolution forms (patches, grouped, Triton implicit GEMM, Gram) against cuDNN's weight
#            gradient -> ops.log
#   test     pytest -m gpu tests/ (240 s: the Triton tests compile a kernel per tile, loop and dtype; not
#            fatal: the benchmark runs whatever the tests say; two xdist workers where installed, so that a
#            test that crashes its process is reported and the rest still run; a failed TMA test sets
#            ELASTICLAB_TRITON_TMA=0 for the later stages, a failed Gram-kernel test ELASTICLAB_TRITON_GHOST=0)
#            -> pytest_gpu.log
#   bench    benchmarks/bench_psgnorm.py --device cuda --max-s 200 $BENCH_ARGS (260 s) -> bench_cuda.log
#   profile  benchmarks/profile_psgnorm.py --device cuda $PROFILE_ARGS (90 s) -> profile.log (top kernels, GPU
#            idle time and its longest gaps, kernels and ATen ops a step, the host operators whose self CPU
#            time grew most over plain); PROFILE2_ARGS: a second profile (60 s,
#            e.g. "--workload W1 --precision fp32", a host-bound step) appended to it; with .before/
#            built, the same profile of the earlier tree (same PROFILE_ARGS, else fp32) is appended to it
#   ray      the Ray backend on the GPU (issue 17): tests/cluster/test_on_ray_gpu.py -m gpu, a RayJob with
#            resource="GPU" training on cuda:0 with NCCL, paused and resumed (RAY_S, 150 s) -> ray.log. Needs
#            Ray carried in .whl/ray/ (its wheel is over the 64 MiB a call carries, so: the wheel unpacked
#            without ray/jars and the dashboard's web client, as ray-stripped.tar.xz, ~30 MB, plus its
#            dependencies' wheels, made by benchmarks/ray_for_gpu.sh). Alone, without building: STAGES="env ray".
# Stage limits: TEST_S, OPS_S, BENCH_S (BENCH_MAX_S: no new workload after it), PROFILE_S; extra arguments:
# OPS_ARGS (bench_seq_linear_cuda.py's, e.g. "--sweep-only G3.up,G3.down"), CONV_ARGS (bench_conv_cuda.py's;
# OPS_CONV=0 leaves it out), BENCH_ARGS, PROFILE_ARGS; TEST_PATHS: what pytest -m gpu collects (tests/).
# $OUT receives eight files: those seven and summary.txt, which is printed at the end. A rerun on the same machine
# can skip stages (STAGES="bench profile": the built extension stays in the tree). The repository is not
# pip-installed there: its root goes first on PYTHONPATH. Wheels in .whl/ (Opacus: pure Python, fetched with
# pip download on a machine with an index) are installed to /tmp/site, which goes last on PYTHONPATH so that
# the machine's own torch wins.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-gpu_out}
STAGES=" ${STAGES:-env build test ops bench profile ray} "
STAGES=${STAGES//,/ }
DEADLINE_S=${DEADLINE_S:-530}
START=$(date +%s)
mkdir -p "$OUT"
: > "$OUT/summary.txt"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1           # a stage killed by its timeout still leaves its output in the log
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} ELASTICLAB_CUDA=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# cuBLAS/cuSPARSE headers carried by torch's nvidia wheels, when present.
NV=$($PY -c 'import site,os;print(next((p for p in (os.path.join(s,"nvidia","cu13","include") for s in site.getsitepackages()) if os.path.isdir(p)),""))' 2>/dev/null)
[ -n "$NV" ] && export CPATH="$NV${CPATH:+:$CPATH}"

say() { echo "$*" | tee -a "$OUT/summary.txt"; }               # stdout and summary
note() { cat >> "$OUT/summary.txt"; }                            # summary only (printed at the end)
want() { [[ "$STAGES" == *" $1 "* ]]; }
# Seconds a stage may take: its own limit, cut to what is left before the deadline (less 20 s for the summary).
budget() { local t=$1 left=$((START + DEADLINE_S - $(date +%s) - 20)); ((left < t)) && t=$left; echo "$t"; }
# run_stage NAME LIMIT LOG CMD...: runs CMD under timeout, output to $OUT/LOG; sets RC (124 = timed out).
run_stage() {
  local name=$1 lim log=$3; lim=$(budget "$2"); shift 3
  if ((lim < 10)); then say "== $name: SKIPPED (deadline ${DEADLINE_S}s reached)"; RC=125; return; fi
  echo "== $name (limit ${lim}s, $(date -u +%T))"
  local t0=$SECONDS
  timeout -k 10 "$lim" "$@" > "$OUT/$log" 2>&1
  RC=$?
  local st=ok
  ((RC != 0)) && st="FAILED rc=$RC"
  ((RC == 124 || RC == 137)) && st="TIMEOUT after ${lim}s"
  say "== $name: $st ($((SECONDS - t0)) s, log $log)"
}

# Wheels carried in .whl/ (always, a few seconds: PYTHONPATH must hold them in every run).
if compgen -G ".whl/*.whl" > /dev/null; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl > /tmp/gpu_check_whl.log 2>&1; then
    rm -rf /tmp/site/benchmarks /tmp/site/examples   # top-level packages the Opacus wheel also ships
    export PYTHONPATH=$PYTHONPATH:/tmp/site
    say "wheels: $(cd .whl && ls *.whl | tr '\n' ' ')-> /tmp/site"
  else
    say "wheels: install FAILED ($(tail -1 /tmp/gpu_check_whl.log)); opacus-ghost will be skipped"
  fi
fi

if want env; then
  run_stage "env" 60 env.txt bash -c "$PY -c 'import torch, sys; print(\"python\", sys.version.split()[0], \"torch\", \
    torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))' || exit 1; \
    $PY -c 'import opacus; print(\"opacus\", opacus.__version__, opacus.__file__)'; \
    $PY -c 'import torchvision; print(\"torchvision\", torchvision.__version__)'; nvidia-smi; nvcc --version; \
    $PY -m pip list 2>/dev/null | grep -i -E 'torch|triton|opacus|numpy|numba|pytest|hypothesis'; true"
  grep -E "^(python|opacus|torchvision) |No module" "$OUT/env.txt" | note
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 | head -2 | note
fi

if want build; then
  rm -f elasticlab/_C*.so
  if [ -f .before/setup.py ]; then        # the earlier tree, built in the background on half the cores
    (cd .before && rm -f elasticlab/_C*.so && MAX_JOBS=8 timeout 170 $PY setup.py build_ext --inplace \
      > /tmp/before_build.log 2>&1; echo "rc=$?" >> /tmp/before_build.log) &
  fi
  run_stage "build" 180 build.log $PY setup.py build_ext --inplace
  ((RC != 0)) && say "   build failed: what follows runs WITHOUT the compiled kernels (tail of build.log:)" \
    && tail -15 "$OUT/build.log" | note
  $PY -m elasticlab info >> "$OUT/build.log" 2>&1
  grep -E "kernels|gpu|cuda|_C" "$OUT/build.log" | grep -v -E "^\[|nvcc|c\+\+|warning" | tail -8 | note
fi

if want test; then
  # Two pytest-xdist workers where the machine has it: a test that crashes its process (SIGSEGV) is then
  # reported as failed and the worker replaced, where one process would end the run (session 10 lost a call).
  XDIST=$($PY -c 'import xdist' > /dev/null 2>&1 && echo "-n 2")
  run_stage "pytest -m gpu ${TEST_PATHS:-tests/} ${XDIST:-(one process)}" "${TEST_S:-240}" pytest_gpu.log \
    $PY -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors $XDIST ${TEST_PATHS:-tests/}
  { grep -E "^(FAILED|ERROR) |crashed while running" "$OUT/pytest_gpu.log" | cut -c1-200 | head -25
    tail -1 "$OUT/pytest_gpu.log"; } | note
  # The TMA kernel had never run on a GPU before this script first ran it: if one of its tests failed or
  # crashed, the later stages leave its variants out (a CUDA fault would end their process).
  if grep -i -E "^(FAILED|ERROR) .*tma|crashed while running.*tma" "$OUT/pytest_gpu.log" > /dev/null; then
    export ELASTICLAB_TRITON_TMA=0
    say "   a TMA test failed: ops, bench and profile run with ELASTICLAB_TRITON_TMA=0 (no TMA variants)"
  fi
  # likewise the fused Gram kernel (triton_gram, first run by this script in session 14 or later)
  G='(test_triton_gram|fused_gram|ghost)'
  if grep -i -E "^(FAILED|ERROR) .*$G|crashed while running.*$G" "$OUT/pytest_gpu.log" > /dev/null; then
    export ELASTICLAB_TRITON_GHOST=0
    say "   a Gram-kernel test failed: ops, bench and profile run with ELASTICLAB_TRITON_GHOST=0 (no ghost forms)"
  fi
fi

if want ops; then
  CONV="; $PY benchmarks/bench_conv_cuda.py ${CONV_ARGS:-}"
  [ "${OPS_CONV:-1}" = 0 ] && CONV=""
  run_stage "bench_seq_linear_cuda${CONV:+ + bench_conv_cuda}" "${OPS_S:-120}" ops.log bash -c \
    "$PY benchmarks/bench_seq_linear_cuda.py ${OPS_ARGS:-}$CONV"
  grep -v "^RESULT" "$OUT/ops.log" | tail -50 | cut -c1-150 | note
fi

if want bench; then
  # stdout (the tables and RESULT) first, then stderr after a separator line: one file, even after a timeout.
  run_stage "bench_psgnorm --device cuda" "${BENCH_S:-260}" bench_cuda.log bash -c \
    "exec $PY benchmarks/bench_psgnorm.py --device cuda --threads 16 --max-s ${BENCH_MAX_S:-200} ${BENCH_ARGS:-} 2> /tmp/bench.err"
  { echo "---- stderr"; tail -c 20000 /tmp/bench.err; } >> "$OUT/bench_cuda.log"
  sed '/^---- stderr$/q' "$OUT/bench_cuda.log" | grep -v -E "^RESULT|^---- stderr" | cut -c1-260 | note
  ((RC != 0)) && tail -12 "$OUT/bench_cuda.log" | note
fi

# a candidate form whose result departed from the first form's (elasticlab.gns.timing: left out, a warning on
# stderr): a kernel that is wrong on this GPU, to fix before any timing of it counts
if grep -q "disagrees with" "$OUT"/ops.log "$OUT"/bench_cuda.log 2>/dev/null; then
  { echo "== WRONG RESULTS: forms left out by the tuner (elasticlab.gns.timing.disagreement)"
    grep -h -o "disagrees with[^']*" "$OUT"/ops.log "$OUT"/bench_cuda.log 2>/dev/null | sort | uniq -c | head -8
  } | cut -c1-260 | note
fi

if want profile; then
  run_stage "profile_psgnorm --device cuda" "${PROFILE_S:-90}" profile.log \
    $PY benchmarks/profile_psgnorm.py --device cuda --threads 16 ${PROFILE_ARGS:-}
  # each table's header, column line and top 4 rows, and the psgn/plain ratio (the full tables: profile.log)
  # and the six kernels whose time grew most over plain's
  awk '/^G[0-9]-/{n=6} n>0{print; n--; next} /GPU idle/{m=4} m>0{print; m--; next} /kernels take .* more than plain/{k=7} k>0{print; k--; next} /\/plain (kernel|CPU op) time|^device /{print}' \
    "$OUT/profile.log" | cut -c1-140 | note
  ((RC != 0)) && grep -v "^RESULT" "$OUT/profile.log" | tail -8 | note
  if [ -f .before/setup.py ]; then
    wait
    if ls .before/elasticlab/_C*.so > /dev/null 2>&1; then
      echo "==== BEFORE (.before/, ${PROFILE_ARGS:---precision fp32})" >> "$OUT/profile.log"
      cp "$OUT/profile.log" /tmp/profile_now.log
      run_stage "profile_psgnorm (before)" 60 profile_before.tmp env PYTHONPATH="$PWD/.before:$PYTHONPATH" \
        $PY benchmarks/profile_psgnorm.py --device cuda --threads 16 ${PROFILE_ARGS:---precision fp32}
      cat /tmp/profile_now.log "$OUT/profile_before.tmp" > "$OUT/profile.log"; rm -f "$OUT/profile_before.tmp"
      sed -n '/==== BEFORE/,$p' "$OUT/profile.log" | awk '/^G[0-9]-[a-z0-9]+ psgn /{n=7} n>0{print; n--}' | cut -c1-140 \
        | sed 's/^/before: /' | note
    else
      say "before: build failed ($(tail -2 /tmp/before_build.log | tr '\n' ' '))"
    fi
  fi
  if [ -n "${PROFILE2_ARGS:-}" ]; then   # a second workload (after the earlier tree: the deadline cuts this first)
    run_stage "profile_psgnorm $PROFILE2_ARGS" 60 profile2.tmp \
      $PY benchmarks/profile_psgnorm.py --device cuda --threads 16 $PROFILE2_ARGS
    if [ -f "$OUT/profile2.tmp" ]; then
      awk '/^[GW][0-9]-/{n=4} n>0{print; n--; next} /GPU idle/{m=3} m>0{print; m--; next} /\/plain (kernel|CPU op) time/{print}' \
        "$OUT/profile2.tmp" | cut -c1-140 | note
      { echo "==== SECOND PROFILE ($PROFILE2_ARGS)"; cat "$OUT/profile2.tmp"; } >> "$OUT/profile.log"
      rm -f "$OUT/profile2.tmp"
    fi
  fi
fi

if want ray; then
  if [ -f .whl/ray/ray-stripped.tar.xz ]; then
    rm -rf /tmp/ray-site && mkdir -p /tmp/ray-site
    # only the dependencies the machine lacks: /tmp/ray-site goes on PYTHONPATH, ahead of site-packages
    need=()
    for w in .whl/ray/*.whl; do
      n=$(basename "$w"); $PY -m pip show -q "${n%%-*}" > /dev/null 2>&1 || need+=("$w")
    done
    say "ray: unpacking Ray and ${#need[@]} dependencies the machine lacks: $(basename -a "${need[@]}" 2>/dev/null \
      | cut -d- -f1 | tr '\n' ' ')"
    tar -xJf .whl/ray/ray-stripped.tar.xz -C /tmp/ray-site && { ((${#need[@]} == 0)) || $PY -m pip install \
      -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ray-site "${need[@]}"; } \
      > /tmp/ray_site.log 2>&1 || say "ray: unpacking .whl/ray FAILED ($(tail -1 /tmp/ray_site.log))"
    run_stage "ray (test_on_ray_gpu.py -m gpu)" "${RAY_S:-150}" ray.log env PYTHONPATH="$PYTHONPATH:/tmp/ray-site" \
      $PY -m pytest -m gpu -v -p no:cacheprovider tests/cluster/test_on_ray_gpu.py
    { grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/ray.log" | cut -c1-200 | head -8; tail -1 "$OUT/ray.log"; } | note
  else
    say "== ray: SKIPPED (no .whl/ray/ray-stripped.tar.xz: run benchmarks/ray_for_gpu.sh here first)"
  fi
fi

echo
echo "===== summary ($OUT/summary.txt; $(($(date +%s) - START)) s in all)"
cat "$OUT/summary.txt"
