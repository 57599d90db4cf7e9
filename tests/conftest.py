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


def pytest_collection_modifyitems(config, items) -> None:
    """Mark each test with its tier, from the folder it lives in (tests/unit, tests/integration)."""
    for item in items:
        tier = item.path.parent.name
        if tier in ("unit", "integration"):
            item.add_marker(getattr(pytest.mark, tier))


# The end-to-end stack fixture lives in tests/support/stack.py; importing it here makes it
# visible to every test module.
from tests.support.stack import llmserve_stack  # noqa: E402, F401
