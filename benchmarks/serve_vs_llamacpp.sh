#!/usr/bin/env bash
# Serving throughput of llama.cpp's OpenAI server and llmserve's whole stack on the same GGUF file,
# one after the other, through the same client (bench_serving_openai.py): each server on core 1
# with one thread, the client on core 0, for each stream count in STREAMS, ROUNDS times.
#
#   GGUF=.../SmolLM2-135M-Instruct.Q4_1.gguf LLAMACPP_PY=/work/llamacpp-venv/bin/python \
#     STREAMS="8 32 64" ROUNDS=2 benchmarks/serve_vs_llamacpp.sh
#
# Requests: STREAMS concurrent (as many requests as streams), ~60-token text prompts, greedy, 32
# tokens each (MAX_TOKENS). Prints one line per run: server, streams, round, tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${GGUF:?set GGUF to a .gguf file}" "${LLAMACPP_PY:?set LLAMACPP_PY to the python of llama-cpp-python}"
STREAMS=${STREAMS:-32} ROUNDS=${ROUNDS:-2} MAX_TOKENS=${MAX_TOKENS:-32}
PY=.venv/bin/python

wait_up() {  # port
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server on port $1 did not come up" >&2
  return 1
}

run_client() {  # name port streams round
  local line
  line=$(taskset -c 0 $PY benchmarks/bench_serving_openai.py --base-url "http://127.0.0.1:$2/v1" \
    --concurrency "$3" --requests "$3" --max-tokens "$MAX_TOKENS")
  echo "$1 streams=$3 round=$4 ${line##*= }"
}

stop() {  # pid
  kill -INT "$1" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$1" 2>/dev/null || true
}

for round in $(seq 1 "$ROUNDS"); do
  OMP_NUM_THREADS=1 taskset -c 1 "$LLAMACPP_PY" -m llama_cpp.server --model "$GGUF" --n_threads 1 \
    --n_threads_batch 1 --n_ctx 4096 --port 8952 >/tmp/serve_llamacpp.log 2>&1 &
  pid=$!
  wait_up 8952
  for s in $STREAMS; do run_client llama.cpp 8952 "$s" "$round"; done
  stop $pid
  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 taskset -c 1 $PY -m scheduler_svc.local.launch --model "$GGUF" \
    --executor-port 50961 --scheduler-port 50951 --frontend-port 8951 \
    --executor-arg=--cpu-threads --executor-arg=1 >/tmp/serve_llmserve.log 2>&1 &
  pid=$!
  wait_up 8951
  for s in $STREAMS; do run_client llmserve 8951 "$s" "$round"; done
  stop $pid
done
