"""KV-aware routing over real processes: two executors behind one scheduler.

Requests sharing a prompt prefix, sent one after another, must all be served where that prefix
is cached under `--routing kv`; `round-robin` (the contrast that shows the test can fail)
alternates and recomputes the prefix on both. The per-executor counts come from GetServerInfo.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import generate, stub_for
from tests.support.stack import start_two_executor_stack

EXECUTOR_ARGS = ["--num-device-blocks", "128", "--swap-space", "0.01"]
BLOCK = 16  # the executor's default block size
PREFIXES = [[(7 * j + k) % 500 + 1 for j in range(4 * BLOCK)] for k in (1, 2)]  # 4 blocks each
PER_PREFIX = 4


@pytest.mark.parametrize(("policy", "hits"), [("kv", 3), ("round-robin", 2)])
def test_requests_follow_their_cached_prefix(tmp_path, policy: str, hits: int) -> None:
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    stack, second = start_two_executor_stack(
        tmp_path, redis, EXECUTOR_ARGS, scheduler_args=["--routing", policy]
    )
    try:
        channel, stub = stub_for(stack.address)
        for prefix in PREFIXES:
            for i in range(PER_PREFIX):
                got = generate(stub, [*prefix, 500 + i, 501 + i], max_tokens=2, ignore_eos=True)
                assert got.error is None and len(got.tokens[0]) == 2
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.routing == policy
        assert len(info.executors) == 2
        total_hits = sum(e.prefix_cache_hits for e in info.executors)
        # kv: every request after a prefix's first finds all of its 4 blocks where it goes;
        # round-robin: only the third and fourth do (each executor computes it once).
        assert total_hits == len(PREFIXES) * hits * 4 * BLOCK, [
            (e.prefix_cache_queries, e.prefix_cache_hits) for e in info.executors
        ]
        # The CLI shows each executor's hit rate (the kv run: one executor served everything).
        cli = subprocess.run(
            [sys.executable, "-m", "client.cli", "info"],
            env={**os.environ, "LLMSERVE_ADDRESS": stack.address},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.count("prefix-cache hit rate") == 2
        assert cli.stdout.count(", float32") == 2  # each executor's dtype (auto: fp32 in tests)
        assert "routing: " + policy in cli.stdout
        if policy == "round-robin":  # both executors served requests
            assert all(e.prefix_cache_queries > 0 for e in info.executors)
        channel.close()
    finally:
        stack.stop()
        second.stop()
        redis.close()
