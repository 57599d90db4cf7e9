"""Graceful drain: SIGTERM to one of two executors under 32 streams, without live migration
(--no-migrate-on-drain, which is also the path a failed migration takes) and with it onto the
other executor while that one is busy too (migration to an idle one: test_migration.py).

The executor says `draining`; the scheduler sends it nothing new and moves what it has not
started; it finishes what it runs for up to --drain-timeout, then exits, and the scheduler
recomputes whatever was left on the other executor at once (no fail-over wait: the fail-over
time here is far longer than the test's budget). Every stream ends exactly as in an undisturbed
run, none fails. Real processes: Redis, two executors, the scheduler.
"""

from __future__ import annotations

import re
import signal

import pytest

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    collect,
    mixed_workload,
    run_in_threads,
    stream_in_threads,
    stub_for,
)
from tests.support.stack import start_two_executor_stack

NUM_STREAMS = 32
BASE_ARGS = ["--num-device-blocks", "256", "--swap-space", "0.01"]


@pytest.mark.parametrize(
    ("drain_timeout", "max_tokens", "expect_left", "migrate"),
    [(60.0, 48, False, False), (0.3, 240, True, False), (60.0, 240, False, True)],
    ids=["finishes-in-place", "rest-moves-on", "migrates-to-the-busy-one"],
)
def test_drain_one_of_two_executors_under_streams(
    tmp_path, drain_timeout: float, max_tokens: int, expect_left: bool, migrate: bool
) -> None:
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    stack, leaving = start_two_executor_stack(
        tmp_path,
        redis,
        BASE_ARGS,
        second_args=[*BASE_ARGS, "--drain-timeout", str(drain_timeout), "--log-level", "info"],
        # A fail-over wait longer than the streams' budget: only the drain path can be in time.
        scheduler_args=["--executor-failover", "600", "--log-level", "info"]
        + ([] if migrate else ["--no-migrate-on-drain"]),
    )
    try:
        channel, stub = stub_for(stack.address)
        reqs = mixed_workload("ref", NUM_STREAMS, max_tokens, rng_seed=5, max_prompt_len=16)
        reference = run_in_threads([lambda r=r: collect(stub.Generate(r)) for r in reqs])
        assert all(r.error is None for r in reference)

        reqs = mixed_workload("drain", NUM_STREAMS, max_tokens, rng_seed=5, max_prompt_len=16)
        results, threads = stream_in_threads(stub, reqs)
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        busy = next(e for e in info.executors if e.address == leaving.executor_address)
        assert busy.num_free_blocks < busy.num_device_blocks, "nothing ran on it"
        leaving.executor_proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "streams hung after the drain"
        for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
            assert got.error is None, (i, got.error)
            assert got.offsets_ok, i  # no token missed or repeated
            assert got.tokens[0] == ref.tokens[0], i
        assert leaving.executor_proc.wait(timeout=60) == 0  # a clean exit
        log = (leaving.workdir / "executor.log").read_text()
        assert "executor.draining" in log and "executor.drained" in log
        scheduler_log = (tmp_path / "scheduler.log").read_text(errors="replace")
        moved = "executor.failed_over" in scheduler_log
        assert moved == expect_left, scheduler_log[-3000:]
        # With migration the running requests move to the other executor, itself running
        # streams (steps planned ahead, its lock taken between two of them); what does not fit
        # there (its watermark) finishes in place.
        migrated = re.search(r"executor.migrated .* moved_requests=([0-9]+)", scheduler_log)
        assert (migrated is not None and int(migrated.group(1)) > 0) == migrate
        # New work goes to the executor that stays.
        after = collect(stub.Generate(reqs[0]))
        assert after.error is None and after.tokens[0] == reference[0].tokens[0]
        channel.close()
    finally:
        stack.stop()
        leaving.stop()
        redis.close()
