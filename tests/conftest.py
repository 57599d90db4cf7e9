"""Session-wide test set-up shared by every test module."""

import os

# Triton must see this before any @triton.jit decorator runs: without a CUDA device the kernels
# run in Triton's interpreter on the CPU.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# lm-eval loads its tasks through `datasets`: the tests' tasks are local files, nothing is fetched.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's HF-equality tolerances are fp32's: `--dtype auto` stays fp32 on CPUs that would
# pick bf16 (AVX512-BF16 / AMX) unless a test asks for bf16 itself (tests/unit/test_cpu_dtype.py).
os.environ.setdefault("LLMSERVE_AUTO_CPU_DTYPE", "float32")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis server on loopback (REDIS_URL is not used: tests must own their server)."""
    from scheduler_svc.local.redis_server import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session Redis server, emptied for this test (and restarted if a test left it
    stopped)."""
    import redis

    if redis_server.proc is None:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


def pytest_report_header(config) -> list[str]:
    """The machine kind in the first lines of every run: kernels are built per instruction set
    and torch/BLAS pick their own, so a failure on one kind of CPU names that kind."""
    import platform
    from pathlib import Path

    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    lines = [
        f"cpu: {model}, {os.cpu_count()} cores; "
        f"flags: {' '.join(f for f in wanted if f in flags) or 'none of ' + ' '.join(wanted)}"
    ]
    try:
        import torch

        from executor_svc.kernels import library

        lines.append(
            f"kernels: variants runnable {library.supported_variants()}, "
            f"LLMSERVE_CPU_ISA={os.environ.get('LLMSERVE_CPU_ISA', 'auto')}; "
            f"torch {torch.__version__} cpu capability {torch.backends.cpu.get_cpu_capability()}, "
            f"cuda {torch.cuda.is_available()}"
        )
    except Exception as err:  # noqa: BLE001 - a header must never fail the run
        lines.append(f"kernels: unknown ({err})")
    try:  # numpy's BLAS (Triton's interpreter runs tl.dot through it) picks kernels per CPU too
        import numpy  # noqa: F401
        from threadpoolctl import threadpool_info

        blas = [f"{i['internal_api']} {i.get('architecture', '?')}" for i in threadpool_info()]
        lines.append(f"blas: {', '.join(blas) or 'none loaded'}")
    except Exception:  # noqa: BLE001, S110 - optional detail
        pass
    return lines


def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test with its tier, from the folder it lives in (tests/unit, tests/integration)."""
    for item in items:
        tier = item.path.parent.name
        if tier in ("unit", "integration"):
            item.add_marker(getattr(pytest.mark, tier))


# The end-to-end stack fixture lives in tests/support/stack.py; importing it here makes it
# visible to every test module.
from tests.support.kernel_variants import use_variant  # noqa: E402, F401
from tests.support.stack import llmserve_stack  # noqa: E402, F401
