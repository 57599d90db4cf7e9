#!/usr/bin/env bash
# OpenAI frontend overhead: the same stack driven over gRPC and through frontend_svc over HTTP,
# alternated ROUNDS times, same workload; optionally vLLM's `vllm serve` on the same checkpoint.
#
#   benchmarks/frontend_overhead.sh MODEL_DIR [NUM_PROMPTS] [CONCURRENCY] [ROUNDS]
#
# MODEL_DIR is a checkpoint directory; build one offline with e.g.
#   .venv/bin/python -m executor_svc.demo.demo_model /tmp/demo            (what `make run` serves)
#   .venv/bin/python -m executor_svc.demo.demo_model /tmp/smol --set hidden_size=576 ...
# VLLM_PY=/path/to/venv/bin/python also runs `vllm serve` (a separate venv, not a dependency),
# with VLLM_ARGS added (e.g. "--dtype float32"; vLLM downcasts fp32 checkpoints to bf16 on CPU).
# STEP_LOG=1: the executor logs every step (debug), summarised by benchmarks/step_log_stats.py;
# GRPC_ONLY=1 skips the HTTP rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
MODEL_DIR=$(realpath "$1")
NUM=${2:-256}
CONC=${3:-64}
ROUNDS=${4:-2}
OUT=${OUT:-/tmp/frontend-overhead}
mkdir -p "$OUT"
SP=$((20000 + RANDOM % 20000))
FP=$((SP + 1))
EP=$((SP + 2))
BENCH=(--workload sharegpt-like --num-prompts "$NUM" --max-concurrency "$CONC" --seed 0 --no-progress)

$PY -m scheduler_svc.local.launch --model "$MODEL_DIR" --scheduler-port "$SP" \
  --executor-port "$EP" --frontend-port "$FP" --redis-dir "$OUT/redis" \
  ${STEP_LOG:+--executor-arg=--log-level=debug} >"$OUT/stack.log" 2>&1 &
STACK=$!
trap 'kill $STACK 2>/dev/null || true; wait $STACK 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$FP/health" >/dev/null 2>&1 && break
  sleep 1
done
for r in $(seq "$ROUNDS"); do
  $PY -m client.bench serve --backend llmserve --address "127.0.0.1:$SP" "${BENCH[@]}" \
    --output "$OUT/grpc-$r.json" | tail -n 20
  [ -n "${GRPC_ONLY:-}" ] && continue
  $PY -m client.bench serve --backend openai --base-url "http://127.0.0.1:$FP/v1" \
    --model-dir "$MODEL_DIR" "${BENCH[@]}" --output "$OUT/http-$r.json" | tail -n 20
done
kill $STACK
wait $STACK 2>/dev/null || true
trap - EXIT
[ -n "${STEP_LOG:-}" ] && $PY benchmarks/step_log_stats.py "$OUT/stack.log"

if [[ -n "${VLLM_PY:-}" ]]; then
  VP=$((SP + 3))
  "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --port "$VP" \
    --max-num-seqs "$CONC" --gpu-memory-utilization 0.3 ${VLLM_ARGS:-} >"$OUT/vllm.log" 2>&1 &
  VLLM=$!
  trap 'kill $VLLM 2>/dev/null || true' EXIT
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$VP/health" >/dev/null 2>&1 && break
    sleep 1
  done
  $PY -m client.bench serve --backend openai --base-url "http://127.0.0.1:$VP/v1" \
    --model-dir "$MODEL_DIR" "${BENCH[@]}" --output "$OUT/vllm.json" | tail -n 20
fi
