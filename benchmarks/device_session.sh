#!/usr/bin/env bash
# Both device issues in one lent device call (15 minutes of device time a session, one machine
# start of a few minutes, at most 10 minutes a command): the GPU steps of issue 45
# (benchmarks/gpu_session.sh) on the first half of the host's cores and, at the same time, the
# AMX steps of issue 44 (benchmarks/device_amx.sh) on the other half; then, if the call's budget
# still has room for it, the many-core scaling step on every core (it needs them all, so it
# waits for the GPU steps).
#
# Why side by side: the GPU steps keep ~4 host cores busy (executor, scheduler, Redis, client)
# and the AMX steps' benchmarks run on 1 or 8 cores; they compare engines within one run
# (ours against oneDNN, overlapped against synced steps), so sharing the host's memory bus
# moves both sides of a ratio alike. Each half's log says which cores it had.
#
# On the device (the wheels from benchmarks/device_wheels.sh in .whl/):
#     run(carry=[".whl"], timeout_s=590): LLMSERVE_MAX_GRAPH_BATCH=1024 MAX_SEQS=1024 \
#         bash benchmarks/device_session.sh
# Environment: GPU_STEPS, AMX_STEPS (the two scripts' step lists), BUDGET_S (this call's
# seconds, default 560), SCALING_AFTER=0 to skip the scaling step. Logs under $OUT (the device
# tool's folder) or ./device-out: gpu/, amx/, and each half's console in gpu.txt and amx.txt.
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT/gpu" "$OUT/amx"
BUDGET_S=${BUDGET_S:-560}
GPU_STEPS=${GPU_STEPS:-overlap pipelined serve serve-sync serve64 tests}
AMX_STEPS=${AMX_STEPS:-env build tests bench1 profile}
here=$(dirname "$0")

# One logical CPU per physical core, split in two halves.
cores=$(cat /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list 2>/dev/null |
  sort -u | cut -d, -f1 | cut -d- -f1 | sort -n)
[ -n "$cores" ] || cores=$(seq 0 $(($(nproc) - 1)))
n=$(echo "$cores" | wc -l)
half=$(((n + 1) / 2))
gpu_cores=$(echo "$cores" | head -"$half" | paste -sd,)
amx_cores=$(echo "$cores" | tail -n +"$((half + 1))" | paste -sd,)
[ -n "$amx_cores" ] || amx_cores=$gpu_cores  # a one-core machine (a dry run): both share it
echo "=== device session $(date -u +%T): GPU steps on cores $gpu_cores, AMX steps on $amx_cores"

start=$SECONDS
# shellcheck disable=SC2086 # step lists
OUT=$OUT/gpu taskset -c "$gpu_cores" bash "$here/gpu_session.sh" $GPU_STEPS >"$OUT/gpu.txt" 2>&1 &
gpu_pid=$!
# shellcheck disable=SC2086
OUT=$OUT/amx taskset -c "$amx_cores" bash "$here/device_amx.sh" $AMX_STEPS >"$OUT/amx.txt" 2>&1
echo "=== AMX steps done after $((SECONDS - start)) s"
wait "$gpu_pid"
echo "=== GPU steps done after $((SECONDS - start)) s"

left=$((BUDGET_S - (SECONDS - start)))
if [ "${SCALING_AFTER:-1}" != 0 ] && [ "$left" -gt 120 ]; then
  # The scaling step's two parts: the kernels (SCALING_TIMEOUT) and two whole-stack runs.
  OUT=$OUT/amx SCALING_TIMEOUT=$(((left - 60) / 2)) SCALING_SERVE_TIMEOUT=$(((left - 60) / 5)) \
    bash "$here/device_amx.sh" scaling >>"$OUT/amx.txt" 2>&1
  echo "=== scaling done after $((SECONDS - start)) s"
else
  echo "=== scaling skipped: $left s left of $BUDGET_S"
fi
echo "=== GPU steps (cores $gpu_cores)"
cat "$OUT/gpu.txt"
echo "=== AMX steps (cores $amx_cores)"
cat "$OUT/amx.txt"
