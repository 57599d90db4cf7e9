"""Two executors behind one scheduler; one dies for good and its requests move to the other.

Real processes throughout: Redis, two executors on the tiny demo model, the scheduler. The
executor that dies is killed with SIGKILL and never comes back; every request it was running
must finish on the survivor with exactly the output an undisturbed run produces (greedy and
seeded sampling), streamed without a gap or a repeated token.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as redis_lib

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    Collected,
    collect,
    mixed_workload,
    run_in_threads,
    stream_in_threads,
    stub_for,
)
from tests.support.stack import Stack, start_two_executor_stack, tiny_model_dir

MAX_TOKENS = 60
NUM_REQUESTS = 8
EXECUTOR_ARGS = ["--num-device-blocks", "256", "--swap-space", "0.01"]


def workload(prefix: str) -> list[pb.GenerateRequest]:
    return mixed_workload(prefix, NUM_REQUESTS, MAX_TOKENS, rng_seed=11, max_prompt_len=16)


def check_outputs(results: list[Collected], reference: list[Collected]) -> None:
    for got, ref in zip(results, reference, strict=True):
        assert got.error is None, got.error
        assert got.offsets_ok  # no token missed or repeated across the move
        assert got.finish[0] == pb.FINISH_REASON_LENGTH
        assert got.tokens[0] == ref.tokens[0]


def test_requests_of_a_dead_executor_finish_on_a_live_one(tmp_path):
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    stack, second = start_two_executor_stack(
        tmp_path, redis, EXECUTOR_ARGS, scheduler_args=["--executor-failover", "0.5"]
    )
    try:
        channel, stub = stub_for(stack.address)
        reference = run_in_threads([lambda r=r: collect(stub.Generate(r)) for r in workload("a")])
        assert all(r.error is None and len(r.tokens[0]) == MAX_TOKENS for r in reference)

        results, threads = stream_in_threads(stub, workload("b"))
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        doomed = next(e for e in info.executors if e.address == second.executor_address)
        assert doomed.num_free_blocks < doomed.num_device_blocks, "nothing ran on it"
        second.executor_proc.kill()  # for good: it never comes back
        second.executor_proc.wait()
        for t in threads:
            t.join(timeout=180)

        check_outputs(results, reference)
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        health = {e.address: e.healthy for e in info.executors}
        assert health == {stack.executor_address: True, second.executor_address: False}
        assert "executor.failed_over" in stack.logs()  # moved, not merely waited for
        channel.close()
    finally:
        stack.stop()
        second.stop()
        redis.close()


def test_executors_found_through_the_redis_registry_including_late_ones(tmp_path):
    """--discover-executors: executors register themselves (heartbeat in Redis); one started
    after the scheduler joins, takes work, and when it dies its requests move on."""
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    registry_args = [*EXECUTOR_ARGS, "--redis-url", redis.url]
    first = Stack(
        workdir=tmp_path,
        model_dir=tiny_model_dir(tmp_path.parent / "models"),
        redis=redis,
        executor_args=registry_args,
        scheduler_args=["--executor-failover", "0.5"],
        discover=True,
    )
    (tmp_path / "late").mkdir()
    late = Stack(
        workdir=tmp_path / "late",
        model_dir=first.model_dir,
        redis=redis,
        executor_args=registry_args,
    )
    raw = redis_lib.Redis.from_url(redis.url)
    try:
        first.start_executor()
        first.start_scheduler()
        channel, stub = stub_for(first.address)
        reference = run_in_threads([lambda r=r: collect(stub.Generate(r)) for r in workload("a")])
        assert all(r.error is None and len(r.tokens[0]) == MAX_TOKENS for r in reference)

        late.start_executor()
        deadline = time.monotonic() + 30
        while len(stub.GetServerInfo(pb.GetServerInfoRequest()).executors) < 2:
            assert time.monotonic() < deadline, "the late executor was not discovered"
            time.sleep(0.1)
        assert raw.scard("llmserve:index:executors") == 2

        # Killed as soon as it holds blocks: waiting for every stream's first tokens instead
        # let it finish its share first on a loaded machine (it has no other work to slow it).
        results, threads = stream_in_threads(stub, workload("b"), min_tokens=0)
        deadline = time.monotonic() + 30
        while True:
            info = stub.GetServerInfo(pb.GetServerInfoRequest())
            joined = next(e for e in info.executors if e.address == late.executor_address)
            if joined.num_free_blocks < joined.num_device_blocks:
                break
            assert time.monotonic() < deadline, "the late executor got no work"
            time.sleep(0.005)
        first_id = next(e.instance_id for e in info.executors if e.address != late.executor_address)
        late.executor_proc.kill()
        late.executor_proc.wait()
        for t in threads:
            t.join(timeout=180)
        check_outputs(results, reference)
        # Its registration lapses (as the heartbeat's expiry would make it): the scheduler drops
        # the dead executor instead of dialling its address for ever (scaling down).
        raw.delete(f"llmserve:executor:{joined.instance_id}")
        deadline = time.monotonic() + 30
        while len(stub.GetServerInfo(pb.GetServerInfoRequest()).executors) > 1:
            assert time.monotonic() < deadline, "the departed executor was never dropped"
            time.sleep(0.1)
        after = collect(stub.Generate(workload("a")[0]))  # still serving, on the survivor
        assert after.tokens[0] == reference[0].tokens[0]
        channel.close()
        first.stop()
        # A clean stop removes the registration at once (a killed executor's merely expires).
        assert not raw.exists(f"llmserve:executor:{first_id}")
        assert first_id.encode() not in raw.smembers("llmserve:index:executors")
    finally:
        first.stop()
        late.stop()
        raw.close()
        redis.close()


def test_discovery_and_static_executors_exclude_each_other():
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", "--discover-executors", "--executor", "h:1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2
    assert "--discover-executors and --executor exclude each other" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-num-batched-tokens", "16"], "max_num_batched_tokens must be >= max_num_seqs"),
        (["--watermark", "1.5"], "watermark must be in [0, 1)"),
        (["--max-waiting", "0"], "max_waiting must be >= 1"),
    ],
)
def test_bad_limits_are_a_usage_error_not_a_traceback(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr
