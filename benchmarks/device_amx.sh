#!/usr/bin/env bash
# The amx kernel variant on an AMX Xeon (the device machine's host CPU), in one run:
#   env     CPU model, AMX flags, cores, compiler, torch
#   build   the amx and avx512bf16 variants (and avx512, avx2 for the variant tests)
#   probe   benchmarks/probe_amx_order.py: TDPBF16PS's order and rounding, emulated and compared
#   tests   the amx tests, the bf16 GEMM and variant tests, and the bf16 step-invariance plans
#           (tests/unit/test_bf16_model.py, with test_step_invariance's workloads), amx loaded
#   bench1  benchmarks/bench_bf16.py, 1 thread: GEMMs of one decode step at batch 1 and 64, and
#           the decode step (fp32, bf16 ours, bf16 torch)
#   bench8  the same GEMMs on 8 threads, one per physical core, with the amx settings
#   sweep   1 thread, batches 1 and 64: the tiles against the vector paths, prefetch distances,
#           load orders
#   profile benchmarks/profile_step.py: the bf16 decode step by op family, batches 1 and 64
# Every step runs whatever the one before did; logs go to $OUT (the device tool's folder) or
# ./amx-out. Wheels the image lacks are installed from $WHEELS when present (docs/benchmarks.md,
# "AMX").
#     OUT=/tmp/o bash benchmarks/device_amx.sh [env build probe tests bench1 bench8 sweep]
set -u
OUT=${OUT:-amx-out}
mkdir -p "$OUT"
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export LLMSERVE_KERNEL_DIR=${LLMSERVE_KERNEL_DIR:-/tmp/llmserve-kernels}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
steps=${*:-env build probe tests bench1 bench8 sweep profile}
# One logical CPU per physical core, the first 8 (AMX is per core: two threads of one core
# would share it).
CORES8=$(cat /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list 2>/dev/null |
  sort -u | cut -d, -f1 | cut -d- -f1 | sort -n | head -8 | paste -sd,)
CORES8=${CORES8:-0-7}

for step in $steps; do
  echo "=== $step $(date -u +%T)"
  case $step in
  env)
    {
      date -u
      lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|MHz|L2|L3'
      echo "amx flags: $(grep -o -w -E 'amx_[a-z0-9]+|avx512_bf16|avx512_vnni' /proc/cpuinfo | sort -u | paste -sd' ')"
      echo "one cpu per core: $CORES8"
      uname -r
      g++ --version | head -1
      $PY -c "import torch; print('torch', torch.__version__, torch.backends.mkldnn.is_available())"
    } 2>&1 | tee "$OUT/env.txt"
    ;;
  build)
    # With $LLMSERVE_KERNEL_LIB a folder of <variant>.so built ahead of time (and CXX a path that
    # is not there, so that they are used), only this compiler's check of the amx source, in
    # the background (the log's end has it).
    if [ -n "${LLMSERVE_KERNEL_LIB:-}" ]; then
      ls -la "$LLMSERVE_KERNEL_LIB"
      (cd executor_svc/kernels/csrc && /usr/bin/time -f "amx gemm_bf16.cpp compiled here: %es" \
        g++ -O3 -ffast-math -fno-associative-math -fopenmp -fPIC -std=c++17 -march=x86-64-v4 \
        -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16 -c gemm_bf16.cpp -o /tmp/amx.o \
        >"$OUT/cxx.log" 2>&1; echo "rc=$?" >>"$OUT/cxx.log") &
    else
      for v in amx avx512bf16 avx512 avx2; do
        timeout 240 $PY -c "from executor_svc.kernels import library as l; print('$v', l._build('$v'))" &
      done
      wait
    fi
    LLMSERVE_CPU_ISA=amx $PY -c "from executor_svc.kernels import gemm_bf16, library as l
print('variant', l.variant(), 'path', gemm_bf16.isa_path(), 'init', l.load().llmserve_amx_init())"
    ;;
  probe)
    LLMSERVE_CPU_ISA=amx timeout 90 $PY benchmarks/probe_amx_order.py 2>&1 | tee "$OUT/probe.log"
    ;;
  tests)
    # 8 workers of 2 threads each (torch's and the kernels' thread count): no oversubscription.
    OMP_NUM_THREADS=2 LLMSERVE_CPU_ISA=amx timeout 150 $PY -m pytest -p no:cacheprovider -v \
      -rsP -n 8 -p no:benchmark --timeout 140 tests/unit/test_gemm_amx.py \
      tests/unit/test_gemm_bf16.py tests/unit/test_kernel_variants.py \
      tests/unit/test_bf16_model.py -k "not describe" >"$OUT/tests.log" 2>&1
    echo "tests rc=$?"
    grep -E "passed|failed|FAILED|Error|assert|of fp32 outputs" "$OUT/tests.log" | head -60
    ;;
  bench1)
    timeout 180 taskset -c "${CORES8%%,*}" $PY benchmarks/bench_bf16.py --threads 1 \
      --batches 1,64 --repeats 5 --iters 5 2>&1 | grep -v "^20..-" | tee "$OUT/bench1.log"
    ;;
  bench8)
    timeout 100 taskset -c "$CORES8" $PY benchmarks/bench_bf16.py --threads 8 --batches 1,64 \
      --repeats 5 --iters 5 --skip-decode --amx-variants 2>&1 | grep -v "^20..-" |
      tee "$OUT/bench8.log"
    ;;
  sweep)
    timeout 100 taskset -c "${CORES8%%,*}" $PY benchmarks/bench_bf16.py --threads 1 \
      --batches 1,64 --repeats 4 --iters 3 --skip-decode --engines ours-bf16 \
      --amx-variants 2>&1 | grep -v "^20..-" | tee "$OUT/sweep.log"
    ;;
  profile)
    timeout 120 taskset -c "${CORES8%%,*}" $PY benchmarks/profile_step.py --dtype bfloat16 \
      --batches 1,64 --iters 5 --no-prefill 2>&1 | grep -v "^20..-" | tee "$OUT/profile.log"
    ;;
  esac
done
wait
cat "$OUT/cxx.log" 2>/dev/null
echo "=== done $(date -u +%T)"
