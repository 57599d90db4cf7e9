"""A leader scheduler and its standby on Redis with replicas and Sentinel: the Redis primary and
the leader are killed -9 at the same moment, mid-stream. The standby takes the lease on the
primary Sentinel promotes (its epoch acknowledged by a replica before it serves), recovers every
request from there, and every client, re-attaching by request id through one channel over both
schedulers, ends with exactly the tokens of an undisturbed run: none missing, none repeated.

Real processes on loopback: 1 primary + 2 replicas + 3 Sentinels, one executor on the tiny demo
model, two schedulers with --leader-election --redis-sentinel --redis-min-replicas 1.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc
from tests.support.api_helpers import (
    Collected,
    collect,
    mixed_workload,
    run_in_threads,
    stream_in_threads,
    stub_for,
)
from tests.support.standby import SERVING, follow_channel, leader_and_standby, resume_in_threads

pytestmark = pytest.mark.timeout(300)

NUM_STREAMS = 24
MAX_TOKENS = 120


def reference_run(pair: tuple) -> list[Collected]:
    with follow_channel(*pair) as ch:
        stub = pb_grpc.SchedulerStub(ch)
        refs = mixed_workload("ref", NUM_STREAMS, MAX_TOKENS, rng_seed=5, max_prompt_len=16)
        return run_in_threads([lambda r=r: collect(stub.Generate(r, timeout=120)) for r in refs])


def wait_admitted(address: str, n: int) -> None:
    """Until the scheduler at ``address`` holds ``n`` requests (waiting, running or swapped)."""
    channel, stub = stub_for(address)
    with channel:
        deadline = time.monotonic() + 60
        while True:
            info = stub.GetServerInfo(pb.GetServerInfoRequest())
            if info.num_waiting + info.num_running + info.num_swapped >= n:
                return
            assert time.monotonic() < deadline, "the requests did not arrive"
            time.sleep(0.01)


def wait_tokens(results: list[Collected], n: int) -> None:
    deadline = time.monotonic() + 60
    while min(len(r.tokens.get(0, [])) for r in results) < n:
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.01)


def test_the_standby_takes_over_when_the_leader_and_the_redis_primary_die_together(tmp_path):
    with leader_and_standby(tmp_path) as (ha, stack, pair):
        leader, standby = pair
        reference = reference_run(pair)
        reqs = mixed_workload("sb", NUM_STREAMS, MAX_TOKENS, rng_seed=5, max_prompt_len=16)
        # The executor waits until every request is in, so that all streams start together: a
        # client thread starting late on a loaded machine let the others run to their end first.
        stack.executor_proc.send_signal(signal.SIGSTOP)
        results, codes, threads = resume_in_threads(pair, reqs, min_tokens=0)
        wait_admitted(leader.address, NUM_STREAMS)
        stack.executor_proc.send_signal(signal.SIGCONT)
        wait_tokens(results, 5)
        assert max(len(r.tokens.get(0, [])) for r in results) < MAX_TOKENS - 20
        killed = ha.kill_primary()
        leader.proc.kill()
        killed_at = time.monotonic()
        ha.wait_failover(killed)
        failover_s = time.monotonic() - killed_at
        for t in threads:
            t.join(timeout=200)
        unfinished = [i for i, r in enumerate(results) if 0 not in r.finish]
        assert not unfinished, (unfinished, standby.log()[-3000:])
        assert set(codes) <= {grpc.StatusCode.UNAVAILABLE}, set(codes)
        for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
            assert ref.error is None and len(ref.tokens[0]) == MAX_TOKENS
            assert got.offsets_ok, f"stream {i}: a token missed or repeated"
            assert got.tokens[0] == ref.tokens[0], f"stream {i} differs from the undisturbed run"
            assert got.text[0] == ref.text[0], f"stream {i}: text differs"
        assert "leader.elected" in standby.log()
        print(f"Redis failover {failover_s:.2f} s; {len(codes)} re-attachments")


def test_with_a_lease_longer_than_a_failover_the_leader_carries_on_and_no_stream_breaks(tmp_path):
    """--leader-lease-ttl 6 outlives a Redis failover (~2.5 s here): the leader keeps its lease
    through the kill -9 of the primary, and its streams pause and continue without a break."""
    with leader_and_standby(tmp_path, "--leader-lease-ttl", "6") as (ha, stack, pair):
        leader, standby = pair
        reference = reference_run(pair)
        reqs = mixed_workload("lt", NUM_STREAMS, MAX_TOKENS, rng_seed=5, max_prompt_len=16)
        channel, stub = stub_for(leader.address)
        results, threads = stream_in_threads(stub, reqs, min_tokens=5)
        stack.executor_proc.send_signal(signal.SIGSTOP)  # the kill lands mid-stream
        assert max(len(r.tokens.get(0, [])) for r in results) < MAX_TOKENS - 20
        killed = ha.kill_primary()
        stack.executor_proc.send_signal(signal.SIGCONT)
        ha.wait_failover(killed)
        for t in threads:
            t.join(timeout=200)
        channel.close()
        for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
            assert got.error is None, f"stream {i} broke: {got.error}"
            assert got.offsets_ok and got.tokens[0] == ref.tokens[0], f"stream {i}"
        assert "leader.lost" not in leader.log() and "leader.elected" not in standby.log()
        assert leader.health() == SERVING
