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
#   scaling many cores, bf16 (<= 150 s on the 16-core host): benchmarks/bench_scaling.py at 1, 4,
#           8, 16 threads, one per physical core (the GEMMs of a decode step, ours and oneDNN's;
#           the decode step at batch 64; its attention, GEMMs and sampler), then the offline
#           throughput of the whole stack (client.bench throughput, sharegpt-like, a
#           SmolLM2-135M-shaped bf16 model with random weights) with the executor on 1 core
#           and on 15, the scheduler, Redis and the client on the core left over. Smaller:
#           SCALING_THREADS=1,2 SCALING_SERVE="1" SCALING_PROMPTS=16
# Every step runs whatever the one before did; logs go to $OUT (the device tool's folder) or
# ./amx-out. Wheels the image lacks are installed from $WHEELS when present (docs/benchmarks.md,
# "AMX").
#     OUT=/tmp/o bash benchmarks/device_amx.sh [env build probe tests bench1 bench8 sweep profile scaling]
set -u
OUT=${OUT:-amx-out}
mkdir -p "$OUT"
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export LLMSERVE_KERNEL_DIR=${LLMSERVE_KERNEL_DIR:-/tmp/llmserve-kernels}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  # Wheels for several Pythons may be there (benchmarks/device_wheels.sh): the pure ones and
  # this interpreter's.
  cp=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheels=$(ls "$WHEELS"/*.whl | grep -E -- "-(py3|py2.py3|$cp|cp[0-9]+-abi3|cp39-abi3)-")
  # shellcheck disable=SC2086 # a list of files
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
steps=${*:-env build probe tests bench1 bench8 sweep profile}
# Every entry point the steps start imports with this interpreter and the carried wheels, before
# any step spends device time (a missing wheel once cost a whole device call).
if ! $PY -c "import executor_svc.cli, scheduler_svc.cli, client.bench.cli
from scheduler_svc.local.redis_server import find_redis_server; find_redis_server()" \
  >"$OUT/preflight.txt" 2>&1; then
  echo "preflight failed: an import is missing (benchmarks/device_wheels.sh)"; cat "$OUT/preflight.txt"
  exit 3
fi
# One logical CPU per physical core (AMX is per core: two threads of one core would share it);
# CORES8: the first 8.
CORES=$(cat /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list 2>/dev/null |
  sort -u | cut -d, -f1 | cut -d- -f1 | sort -n | paste -sd,)
CORES=${CORES:-$(seq -s, 0 $(($(nproc) - 1)))}
# Run under taskset (benchmarks/device_session.sh gives this script half of the host while the
# GPU steps use the other half): only the cores this process may use.
ALLOWED=$($PY -c 'import os; print(" ".join(map(str, sorted(os.sched_getaffinity(0)))))')
keep_allowed() { tr , '\n' | while read -r c; do case " $ALLOWED " in *" $c "*) echo "$c" ;; esac; done | paste -sd,; }
CORES=$(echo "$CORES" | keep_allowed)
CORES8=$(echo "$CORES" | tr , '\n' | head -8 | paste -sd,)
NCORES=$(echo "$CORES" | tr , '\n' | wc -l)

# The whole stack serving sharegpt-like prompts offline, with the executor on $n cores (one
# thread each) after the first of $CORES, for each n of $SCALING_SERVE; the scheduler, its Redis
# and the client share the first core. One line per run.
serve_throughput() {
  local work n cores first epid spid
  work=$(mktemp -d)
  first=${CORES%%,*}
  $PY -m executor_svc.demo.demo_model "$work/m" --no-weights --set hidden_size=576 \
    --set num_hidden_layers=30 --set num_attention_heads=9 --set num_key_value_heads=3 \
    --set intermediate_size=1536 --set vocab_size=49152 --set max_position_embeddings=8192 \
    --set rope_theta=100000.0 --set tie_word_embeddings=true --set initializer_range=0.02 \
    >/dev/null
  for n in ${SCALING_SERVE:-1 15}; do
    cores=$(echo "$CORES" | tr , '\n' | sed 1d | head -"$n" | paste -sd,)
    rm -f "$work"/*.port
    $PY -m executor_svc --model "$work/m" --device cpu --dtype bfloat16 --load-format dummy \
      --cpu-cores "$cores" --cpu-threads "$n" --port 0 --port-file "$work/executor.port" \
      --log-level warning >"$OUT/serve-$n.log" 2>&1 &
    epid=$!
    for _ in $(seq 240); do
      [ -s "$work/executor.port" ] || ! kill -0 "$epid" 2>/dev/null && break; sleep 0.25
    done
    taskset -c "$first" $PY -m scheduler_svc --executor "127.0.0.1:$(cat "$work/executor.port")" \
      --redis-dir "$work/redis-$n" --port 0 --port-file "$work/scheduler.port" \
      --max-num-seqs "${SCALING_MAX_SEQS:-64}" --log-level warning >>"$OUT/serve-$n.log" 2>&1 &
    spid=$!
    for _ in $(seq 240); do
      [ -s "$work/scheduler.port" ] || ! kill -0 "$spid" 2>/dev/null && break; sleep 0.25
    done
    taskset -c "$first" timeout "${SCALING_SERVE_TIMEOUT:-50}" $PY -m client.bench throughput \
      --backend llmserve --address "127.0.0.1:$(cat "$work/scheduler.port")" \
      --workload sharegpt-like --num-prompts "${SCALING_PROMPTS:-20}" --no-progress \
      --output "$work/tp-$n.json" >>"$OUT/serve-$n.log" 2>&1
    echo "rc=$?" >>"$OUT/serve-$n.log"
    $PY -c "import json, sys
r, n, p = json.load(open(sys.argv[1]))['results'][0], sys.argv[2], sys.argv[3]
print(f'scaling throughput executor_threads={n} prompts={p} completed={r[\"completed\"]}',
      f'duration_s={r[\"duration_s\"]:.2f} output_tok_s={r[\"output_throughput\"]:.1f}',
      f'total_tok_s={r[\"total_token_throughput\"]:.1f}')" "$work/tp-$n.json" "$n" \
      "${SCALING_PROMPTS:-20}" 2>/dev/null || echo "scaling throughput executor_threads=$n failed"
    kill "$spid" 2>/dev/null; sleep 1; kill "$epid" 2>/dev/null; wait "$spid" "$epid" 2>/dev/null
  done
}

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
    # A worker of 2 threads (torch's and the kernels' thread count) per two cores: 8 on the
    # whole 16-core host, no oversubscription.
    workers=$(( NCORES / 2 > 0 ? NCORES / 2 : 1 ))
    OMP_NUM_THREADS=2 LLMSERVE_CPU_ISA=amx timeout "${TESTS_TIMEOUT:-$((150 * 8 / workers))}" \
      $PY -m pytest -p no:cacheprovider -v \
      -rsP -n "$workers" -p no:benchmark --timeout 140 tests/unit/test_gemm_amx.py \
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
 scaling)
    timeout "${SCALING_TIMEOUT:-70}" $PY benchmarks/bench_scaling.py --cores "$CORES" \
      --threads "${SCALING_THREADS:-1,4,8,16}" --iters "${SCALING_ITERS:-5}" 2>&1 |
      grep -E "^scaling|Error" | tee "$OUT/scaling.log"
    serve_throughput | tee -a "$OUT/scaling.log"
    ;;
  esac
done
wait
cat "$OUT/cxx.log" 2>/dev/null
echo "=== done $(date -u +%T)"
