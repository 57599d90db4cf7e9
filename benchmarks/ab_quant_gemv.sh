#!/usr/bin/env bash
# The quantized matmul kernels of two trees, alternated in one loop on one core (ratios within
# a round): bench_quant_gemv.py run from each tree with that tree's kernels.
#   benchmarks/ab_quant_gemv.sh BASE_TREE [NEW_TREE (default: this checkout)] [ROUNDS (2)]
# A base tree: `git worktree add /tmp/base <commit>`. Extra bench_quant_gemv.py arguments in
# ARGS (default: --types Q4_1,Q4_0,Q8_0 --rows 1,2,5,8,32,512 --rounds 1 --seconds 0.2).
set -eu
base=$1
new=${2:-$(cd "$(dirname "$0")/.." && pwd)}
rounds=${3:-2}
py=${PY:-$new/.venv/bin/python}
args=${ARGS:---types Q4_1,Q4_0,Q8_0 --rows 1,2,5,8,32,512 --rounds 1 --seconds 0.2}
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|amx_tile)$' \
  | tr '\n' ' '
echo
for round in $(seq "$rounds"); do
  for tree in "$base" "$new"; do
    echo "== round $round $tree"
    # shellcheck disable=SC2086 # args is a list of options
    (cd "$tree" && OMP_NUM_THREADS=1 PYTHONPATH=$tree taskset -c "${CORE:-1}" "$py" \
      benchmarks/bench_quant_gemv.py $args | grep "one SmolLM2")
  done
done
