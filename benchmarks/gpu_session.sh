#!/usr/bin/env bash
# One GPU session's checks and benchmarks, in the order a lent GPU's time is best spent:
#   tests   the GPU tests (pytest -m gpu: Triton kernels compiled for real, the runner against
#           HF in fp32/bf16/fp16, CUDA-graph replay against eager, step invariance on CUDA)
#   probe   benchmarks/cuda_invariance_probe.py: the first op whose result for a position depends
#           on the step around it (fp32, fp32 with LLMSERVE_CUDA_INVARIANT=1, bf16)
#   invariance  the CUDA invariance test with LLMSERVE_CUDA_INVARIANT=1 and --runxfail
#   decode  benchmarks/bench_decode.py --device cuda (SmolLM-135M shape, fp32)
#   overlap tests/unit/test_overlap_steps.py on CUDA: steps launched on draws still on the GPU
#   pipelined  benchmarks/profile_cuda_step.py: the 8B-shaped decode step synced and pipelined
#           against the weight-read floor, and the kernel profile of a batch-256 decode step
#   serve   a Llama-3-8B-shaped bf16 model (random weights, --load-format dummy) served by the
#           real stack (executor + scheduler + Redis), driven by the benchmark harness with
#           NUM_PROMPTS sharegpt-like prompts, all at once (offline throughput)
#   serve-sync  the same with LLMSERVE_OVERLAP_STEPS=0 (every step's draws on the host first)
#   serve64 the same stack behind the HTTP frontend, client.bench serve through its OpenAI
#           API (the openai backend): 64 concurrent streams (TTFT, ITL)
#   serve64-grpc  the same, the harness calling the scheduler's gRPC API directly
# Usage: benchmarks/gpu_session.sh [probe] [tests] [invariance] [decode] [overlap] [pipelined]
#        [serve] [serve-eager] [serve-sync] [serve64] [serve64-grpc]   (default: tests decode serve)
# Logs go to $OUT (the device tool's folder) or ./gpu-out. Wheels the image lacks are installed
# from .whl/ when present (see docs/benchmarks.md, "CUDA").
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
NUM_PROMPTS=${NUM_PROMPTS:-1000}
MAX_SEQS=${MAX_SEQS:-512}
DEVICE=${DEVICE:-cuda}
# The served shape: Llama-3-8B's (SHAPE overrides it, e.g. for a dry run on a CPU).
SHAPE=${SHAPE:-"--set hidden_size=4096 --set num_hidden_layers=32 --set num_attention_heads=32
 --set num_key_value_heads=8 --set intermediate_size=14336 --set vocab_size=128256
 --set max_position_embeddings=8192 --set rope_theta=500000.0 --set tie_word_embeddings=false"}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  # Wheels for several Pythons may be there: the pure ones and this interpreter's.
  cp=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheels=$(ls .whl/*.whl | grep -E -- "-(py3|py2.py3|$cp|cp[0-9]+-abi3)-")
  # shellcheck disable=SC2086 # a list of files
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export PATH=/tmp/site/bin:$PATH
steps=${*:-tests decode serve}

# Before any device time goes to a step: every entry point imports with this interpreter and
# the carried wheels (a missing package, e.g. grpcio-reflection or llguidance, once cost a
# whole device call; docs/benchmarks.md "CUDA" lists the wheels to carry).
if ! $PY -c "import executor_svc.cli, scheduler_svc.cli, client.bench.cli, frontend_svc.cli, openai
from scheduler_svc.local.redis_server import find_redis_server; find_redis_server()" \
  >"$OUT/preflight.txt" 2>&1; then
  echo "preflight failed: an import is missing (carry its wheel in .whl/)"; cat "$OUT/preflight.txt"
  exit 3
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__)"
  lscpu | grep -E 'Model name|^CPU\(s\)'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

for step in $steps; do
  case $step in
  tests)
    timeout "${TESTS_TIMEOUT:-330}" $PY -m pytest -p no:cacheprovider -m gpu -s -q -rs --timeout 300 \
      tests/unit/test_cuda_runner.py tests/unit/test_triton_kernels.py \
      tests/unit/test_sampler.py tests/unit/test_step_invariance.py tests/unit/test_spec_cuda.py \
      >"$OUT/tests.log" 2>&1
    echo "tests rc=$?"; tail -25 "$OUT/tests.log"
    ;;
  probe)
    for cfg in "0 float32" "1 float32" "0 bfloat16"; do
      set -- $cfg
      LLMSERVE_CUDA_INVARIANT=$1 timeout 90 $PY benchmarks/cuda_invariance_probe.py \
        --device cuda --dtype "$2" 2>&1 | grep -v "^20..-" | tee -a "$OUT/probe.log"
    done
    ;;
  invariance)
    LLMSERVE_CUDA_INVARIANT=1 timeout "${INV_TIMEOUT:-120}" $PY -m pytest -p no:cacheprovider \
      -m gpu -q --runxfail --timeout 110 \
      tests/unit/test_step_invariance.py -k triton_cuda >"$OUT/invariance.log" 2>&1
    echo "invariance rc=$?"; grep -E "differences|passed|failed" "$OUT/invariance.log" | tail -5
    ;;
  overlap)
    timeout 120 $PY -m pytest -p no:cacheprovider -q --timeout 110 tests/unit/test_overlap_steps.py \
      >"$OUT/overlap.log" 2>&1
    echo "overlap rc=$?"; tail -3 "$OUT/overlap.log"
    ;;
  pipelined)
    timeout "${PIPE_TIMEOUT:-150}" $PY benchmarks/profile_cuda_step.py --context 384 \
      --batches 1,8,64,256 --iters 20 --profile-batch 256 >"$OUT/pipelined.log" 2>&1
    echo "pipelined rc=$?"; grep -E "^\||prefill|weights" "$OUT/pipelined.log" | head -12
    ;;
  decode)
    timeout 150 $PY benchmarks/bench_decode.py --device cuda --batches 1,8,32,64,256 \
      --repeats 3 --iters 20 >"$OUT/decode.log" 2>&1
    echo "decode rc=$?"; tail -15 "$OUT/decode.log"
    ;;
  serve | serve-eager | serve-sync | serve64 | serve64-grpc)
    extra=()
    [ "$step" = serve-eager ] && extra=(--enforce-eager)
    overlap=auto
    [ "$step" = serve-sync ] && overlap=0
    work=$(mktemp -d)
    # shellcheck disable=SC2086 # SHAPE is a list of options
    $PY -m executor_svc.demo.demo_model "$work/llama3-8b-shape" --no-weights $SHAPE \
      --set initializer_range=0.02 >/dev/null
    log="$OUT/$step.log"
    LLMSERVE_OVERLAP_STEPS=$overlap \
    $PY -m executor_svc --model "$work/llama3-8b-shape" --device "$DEVICE" --dtype bfloat16 \
      --load-format dummy --port 0 --port-file "$work/executor.port" --log-level info \
      --metrics-port 9464 \
      "${extra[@]}" ${EXECUTOR_ARGS:-} >"$log" 2>&1 &
    epid=$!
    # Waits end as soon as the process is gone (a start that fails must not eat device time).
    for _ in $(seq 600); do
      [ -s "$work/executor.port" ] || ! kill -0 $epid 2>/dev/null && break; sleep 0.5
    done
    if [ ! -s "$work/executor.port" ]; then
      echo "$step: the executor did not start"; tail -5 "$log"; continue
    fi
    $PY -m scheduler_svc --executor "127.0.0.1:$(cat "$work/executor.port")" \
      --redis-dir "$work/redis" --port 0 --port-file "$work/scheduler.port" \
      --max-num-seqs "$MAX_SEQS" --max-num-batched-tokens 8192 --log-level warning \
      --metrics-port 9465 \
      >>"$log" 2>&1 &
    spid=$!
    for _ in $(seq 240); do
      [ -s "$work/scheduler.port" ] || ! kill -0 $spid 2>/dev/null && break; sleep 0.5
    done
    if [ ! -s "$work/scheduler.port" ]; then
      echo "$step: the scheduler did not start"; tail -5 "$log"; kill "$epid"; continue
    fi
    if [ -n "${PROFILE:-}" ] && command -v py-spy >/dev/null; then
      # Where the two processes' CPU time goes, as collapsed stacks (one line per stack).
      (sleep "${PROFILE_DELAY:-12}"
       py-spy record --format raw -r 40 -d 15 -o "$OUT/prof-executor.txt" --pid "$epid" &
       py-spy record --format raw -r 40 -d 15 -o "$OUT/prof-scheduler.txt" --pid "$spid" &
       nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader -l 1 >"$OUT/gpu-util.txt" &
       sleep 16; kill %3) >/dev/null 2>&1 &
    fi
    fpid=
    if [ "$step" = serve64 ]; then
      $PY -m frontend_svc --scheduler "127.0.0.1:$(cat "$work/scheduler.port")" --port 0 \
        --port-file "$work/frontend.port" --log-level warning >>"$log" 2>&1 &
      fpid=$!
      for _ in $(seq 120); do
        [ -s "$work/frontend.port" ] || ! kill -0 $fpid 2>/dev/null && break; sleep 0.5
      done
      if [ ! -s "$work/frontend.port" ]; then
        echo "$step: the frontend did not start"; tail -5 "$log"; kill "$spid" "$epid"; continue
      fi
    fi
    t0=$SECONDS
    if [ "$step" = serve64 ]; then
      timeout "${SERVE_TIMEOUT:-300}" $PY -m client.bench serve --backend openai \
        --base-url "http://127.0.0.1:$(cat "$work/frontend.port")/v1" \
        --model-dir "$work/llama3-8b-shape" --workload sharegpt-like \
        --num-prompts "${SERVE64_PROMPTS:-256}" --max-concurrency 64 --no-progress \
        --output "$OUT/$step.json" >>"$log" 2>&1
    elif [ "$step" = serve64-grpc ]; then
      timeout "${SERVE_TIMEOUT:-300}" $PY -m client.bench serve --backend llmserve \
        --address "127.0.0.1:$(cat "$work/scheduler.port")" --workload sharegpt-like \
        --num-prompts "${SERVE64_PROMPTS:-256}" --max-concurrency 64 --no-progress \
        --output "$OUT/$step.json" >>"$log" 2>&1
    else
      timeout "${SERVE_TIMEOUT:-300}" $PY -m client.bench throughput --backend llmserve \
        --address "127.0.0.1:$(cat "$work/scheduler.port")" --workload sharegpt-like \
        --num-prompts "$NUM_PROMPTS" --no-progress --output "$OUT/$step.json" >>"$log" 2>&1
    fi
    echo "$step rc=$? wall $((SECONDS - t0)) s (with the harness's warm-up)"
    $PY -c "import urllib.request as u
for p in (9464, 9465): print(u.urlopen(f'http://127.0.0.1:{p}/metrics').read().decode())" \
      | grep -E "^llmserve:(executor_phase|executor_step|redis_write|num_steps|executor_steps)" \
      >"$OUT/$step-metrics.txt"
    cat "$OUT/$step-metrics.txt"
    [ -n "$fpid" ] && kill "$fpid" 2>/dev/null
    kill "$spid" 2>/dev/null; sleep 2; kill "$epid" 2>/dev/null; wait 2>/dev/null
    grep -E "cuda_graphs|num_device_blocks|kv_cache|error|Error" "$log" | head -8
    cat "$OUT/$step.md" 2>/dev/null || tail -20 "$log"
    ;;
  esac
done
