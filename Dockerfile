# One image for every llmserve role (executor, scheduler, frontend, client); docker-compose.yml picks the
# role with `command:`. Build: `docker build -t llmserve:local .`
#
# CPU by default. For GPU hosts, build with CUDA wheels of torch instead of the CPU ones:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t llmserve:cuda .
# (use the cuXYZ index that carries torch 2.13.0 for your driver). Those wheels bundle the CUDA
# runtime, so the slim Python base still works; the host needs the NVIDIA driver and the NVIDIA
# Container Toolkit. To build on a CUDA base image instead, pass e.g.
#   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# and make sure that base provides Python >= 3.11 as `python`/`pip` (Ubuntu's needs a venv).
ARG BASE_IMAGE=python:3.11-slim

# The CPU kernel library (paged attention, GEMMs, sampling, elementwise), compiled ahead of time
# in a stage of its own, one library per instruction-set variant (executor_svc/kernels/library.py
# VARIANTS: name, then its -march flags), so the image carries the libraries and not the
# compiler; the executor loads the best one its CPU runs. The flags are library.py's FLAGS plus
# the variant's (a test keeps them equal).
FROM ${BASE_IMAGE} AS kernel
RUN apt-get update -q && apt-get install -y -q --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY executor_svc/kernels/csrc/ /src/
# (A variant the compiler or the architecture refuses is left out; with none, the executor uses
# the torch paths.) The four variants compile at once.
RUN mkdir -p /out && for v in \
        "amx:-march=x86-64-v4 -mavx512bf16 -mavx512vnni -mamx-tile -mamx-bf16" \
        "avx512bf16:-march=x86-64-v4 -mavx512bf16 -mavx512vnni" \
        "avx512:-march=x86-64-v4" "avx2:-march=x86-64-v3"; do \
      name="${v%%:*}"; march="${v#*:}"; \
      ( g++ -O3 -ffast-math -fno-associative-math -fopenmp -shared -fPIC -std=c++17 $march \
        /src/*.cpp -o "/out/$name.so" || rm -f "/out/$name.so" ) & \
    done; wait

FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    LLMSERVE_CACHE=/home/llmserve/.cache/llmserve

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin llmserve

# The prebuilt kernel library and the OpenMP runtime it links (on a CPU without AVX2/FMA the
# executor uses the torch attention ops instead).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends libgomp1 \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
COPY --from=kernel /out/ /opt/llmserve/kernels/
ENV LLMSERVE_KERNEL_LIB=/opt/llmserve/kernels
WORKDIR /opt/llmserve

# torch first and from its own index: the project pins torch==2.13.0, which the local build
# (2.13.0+cpu or +cuXYZ) already satisfies, so the PyPI install below never swaps it out.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

# Dependencies in their own layer, keyed on pyproject.toml only, so editing source code does not
# reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(deps))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY protos ./protos
COPY scheduler_svc ./scheduler_svc
COPY executor_svc ./executor_svc
COPY client ./client
COPY frontend_svc ./frontend_svc
RUN pip install --no-deps . && rm -rf build *.egg-info

USER llmserve
# Bake the demo checkpoint into the image (a few seconds) so `--model demo` starts at once and
# every scaled executor replica serves identical weights.
RUN python -c "from executor_svc.demo.demo_model import ensure_demo_model; print(ensure_demo_model())"
RUN python -c "from executor_svc.kernels import library; print('cpu kernel:', library.available())"

# gRPC: scheduler 50051, executor 50061; HTTP: frontend 8000, metrics 9400 (scheduler) 9401 (executor).
EXPOSE 50051 50061 8000 9400 9401
CMD ["llmserve-executor", "--model", "demo", "--host", "0.0.0.0", "--port", "50061"]
