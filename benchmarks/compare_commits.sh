#!/usr/bin/env bash
# Scheduler CPU benchmarks at 256 sequences for another commit and the working tree, alternated
# in one run (this machine's speed drifts between runs; compare rows of the same run only).
#
#   benchmarks/compare_commits.sh 75a7ad1 [rounds]
#
# The other commit is checked out in a temporary git worktree and run with this venv.
set -euo pipefail
base=${1:?usage: $0 COMMIT [ROUNDS]}
rounds=${2:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
tree=$(mktemp -d)
git -C "$here" worktree add --detach -q "$tree" "$base"
trap 'git -C "$here" worktree remove --force "$tree"' EXIT
export HF_HUB_OFFLINE=1
for round in $(seq "$rounds"); do
  for side in "$base" working-tree; do
    dir=$tree
    [ "$side" = working-tree ] && dir=$here
    echo "== $side, round $round: bench_scheduler.py (256 rows)"
    (cd "$dir" && PYTHONPATH=$dir "$py" benchmarks/bench_scheduler.py | grep '^| 256')
    echo "== $side, round $round: bench_engine_step.py --batches 256"
    (cd "$dir" && PYTHONPATH=$dir "$py" benchmarks/bench_engine_step.py --batches 256 --repeats 3 \
      | grep '^| 256')
  done
done
