"""Failure paths that never hang: start-up under load, truthful health, Redis refusing writes,
a step that raises, an executor that comes back with another cache shape or after a restart.

Real processes throughout (Redis, executor, scheduler); faults are real (kill -9, Redis turned
into a read-only replica or refusing writes), except the step crash, which no input triggers
today and is injected through a failpoint (scheduler_svc/failpoints.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis as redis_lib
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    Collected,
    collect,
    generate,
    mixed_workload,
    reference_run,
    run_in_threads,
    stream_in_threads,
    stub_for,
)
from tests.support.redis_ha import RedisHA
from tests.support.stack import make_stack

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(data_dir=tmp_path / "redis")
    server.start()
    yield server
    server.close()


def health(address: str) -> int | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(), timeout=2)
                .status
            )
        except grpc.RpcError:
            return None


def wait_health(address: str, want: int, timeout: float = 20.0) -> float:
    """Seconds until health reports `want`; fails after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if health(address) == want:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"health did not become {want} within {timeout}s (is {health(address)})")


def assert_same(got: Collected, ref: Collected, what: str) -> None:
    assert got.error is None, f"{what}: {got.error}"
    assert got.offsets_ok, f"{what}: a gap or a repeat"
    assert got.finish.get(0) == pb.FINISH_REASON_LENGTH, f"{what}: finish {got.finish}"
    assert got.tokens[0] == ref.tokens[0], f"{what}: output differs from the undisturbed run"
    assert got.text[0] == ref.text[0], f"{what}: text differs from the undisturbed run"


# ---------------------------------------------------------------- start-up under load


def test_reattaching_clients_through_repeated_restarts_see_undisturbed_streams(
    tmp_path, redis, monkeypatch
):
    """Clients re-attach as fast as they can while the scheduler is killed and restarted: an
    engine still starting answers UNAVAILABLE (never UNKNOWN, never a premature finish), and
    every stream ends exactly as an undisturbed one.

    Start-up is held for a moment after the tokenizer is loaded and before the model's limits
    are known, the window in which a Resume once replayed stored tokens against a length limit
    of zero and finished the stream by LENGTH; real timing leaves it a few milliseconds wide."""
    monkeypatch.setenv("LLMSERVE_FAILPOINTS", "engine.start=delay:1.0")
    num_clients, max_tokens, num_restarts = 24, 96, 3
    stack = make_stack(tmp_path, redis)
    try:
        reqs = mixed_workload("att", num_clients, max_tokens, rng_seed=9)
        reference = reference_run(stack.address, reqs)
        results = [Collected() for _ in reqs]
        codes: list[grpc.StatusCode] = []
        stop = threading.Event()
        unfinished: list[int] = []  # streams still running at each kill

        def client(i: int, req: pb.GenerateRequest) -> None:
            got = results[i]
            deadline = time.monotonic() + 240
            while 0 not in got.finish and time.monotonic() < deadline and not stop.is_set():
                # A channel of its own each time: channels in one process otherwise share a
                # connection and its reconnect back-off, and would all miss the start-up window.
                channel = grpc.insecure_channel(
                    stack.address, options=[("grpc.use_local_subchannel_pool", 1)]
                )
                stub = pb_grpc.SchedulerStub(channel)
                try:
                    if not got.messages:  # same id again attaches: never a second generation
                        stream = stub.Generate(req, timeout=120)
                    else:
                        resume = pb.ResumeRequest(
                            request_id=req.request_id, from_token_index=len(got.tokens[0])
                        )
                        stream = stub.Resume(resume, timeout=120)
                    for msg in stream:
                        got.add(msg)
                except grpc.RpcError as e:
                    codes.append(e.code())
                    time.sleep(0.02)
                finally:
                    channel.close()

        threads = [threading.Thread(target=client, args=(i, r)) for i, r in enumerate(reqs)]
        for t in threads:
            t.start()
        try:
            for _ in range(num_restarts):
                before = sum(len(r.tokens.get(0, [])) for r in results)
                deadline = time.monotonic() + 30
                while sum(len(r.tokens.get(0, [])) for r in results) < before + num_clients:
                    if time.monotonic() > deadline:
                        break  # stalled: the assertions below say how
                    time.sleep(0.02)
                unfinished.append(sum(0 not in r.finish for r in results))
                stack.kill_scheduler()
                stack.start_scheduler()
        finally:
            for t in threads:
                t.join(timeout=240)
            stop.set()
        unexpected = {c for c in codes if c != grpc.StatusCode.UNAVAILABLE}
        assert not unexpected, f"clients saw {unexpected} while the scheduler restarted"
        for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
            assert_same(got, ref, f"client {i}")
        assert codes, "no client ever hit a restart"
        assert min(unfinished) > 0, unfinished
    finally:
        stack.stop()


# ---------------------------------------------------------------- truthful health


def test_health_follows_redis_and_the_executor(tmp_path, redis):
    stack = make_stack(tmp_path, redis)
    try:
        address = stack.address
        assert health(address) == SERVING
        # Redis down, then back.
        redis.stop()
        wait_health(address, NOT_SERVING, timeout=10)
        redis.start()
        wait_health(address, SERVING, timeout=10)
        # Redis up but refusing writes (a read-only replica), then a primary again.
        raw = redis_lib.Redis.from_url(redis.url)
        raw.replicaof("127.0.0.1", 1)
        wait_health(address, NOT_SERVING, timeout=10)
        raw.replicaof("NO", "ONE")
        wait_health(address, SERVING, timeout=10)
        raw.close()
        # The only executor dies while idle, then a new one starts on its port.
        stack.executor_proc.kill()
        stack.executor_proc.wait()
        wait_health(address, NOT_SERVING, timeout=10)
        channel, stub = stub_for(address)
        res = generate(stub, [1, 2, 3], max_tokens=2)
        assert res.error is not None and res.error.code() == grpc.StatusCode.UNAVAILABLE
        stack.start_executor()
        wait_health(address, SERVING, timeout=30)
        res = generate(stub, [1, 2, 3], max_tokens=4, ignore_eos=True)  # sampled: EOS could end it
        assert res.error is None and len(res.tokens[0]) == 4
        channel.close()
    finally:
        stack.stop()


def test_health_follows_the_redis_primary_and_its_replicas(tmp_path):
    """With replicas and Sentinel (--redis-min-replicas 2): NOT_SERVING, saying why, while a
    replica acknowledges nothing, even with no request running; NOT_SERVING while the primary
    is dead, SERVING again once Sentinel has promoted a replica and two replicas answer; and
    nothing crashes on the way."""
    with redis_topology(tmp_path, "ha") as (primary, _, ha):
        assert ha is not None
        args = ["--redis-sentinel", ha.sentinel_arg, "--redis-min-replicas", "2",
                "--health-interval", "0.2"]  # fmt: skip
        stack = make_stack(tmp_path, primary, scheduler_args=args)
        try:
            address = stack.address
            assert health(address) == SERVING
            stalled = ha.replicas()[0]
            ha.pause(stalled)
            wait_health(address, NOT_SERVING, timeout=10)
            ha.resume(stalled)
            wait_health(address, SERVING, timeout=10)
            killed = ha.kill_primary()
            wait_health(address, NOT_SERVING, timeout=10)
            ha.wait_failover(killed)
            ha.restart_as_replica(killed)
            wait_health(address, SERVING, timeout=30)
            channel, stub = stub_for(address)
            res = generate(stub, [1, 2, 3], max_tokens=4, ignore_eos=True)
            assert res.error is None and len(res.tokens[0]) == 4
            channel.close()
            log = (tmp_path / "scheduler.log").read_text()
            assert "1 of 2 Redis replicas acknowledged" in log
            assert "Traceback" not in log
        finally:
            stack.stop()


# ---------------------------------------------------------------- Redis refusing writes


@contextlib.contextmanager
def redis_topology(
    tmp_path, topology: str
) -> Iterator[tuple[RedisServer, list[str], RedisHA | None]]:
    """The Redis a stack runs on: "single" (one server) or "ha" (a primary, 2 replicas and 3
    Sentinels; the scheduler follows the Sentinels and waits for 1 replica per step). Yields
    the node that takes writes now, the scheduler flags for it, and the HA topology if any."""
    if topology == "single":
        server = RedisServer(data_dir=tmp_path / "redis")
        server.start()
        try:
            yield server, [], None
        finally:
            server.close()
        return
    ha = RedisHA(tmp_path / "redis-ha").start()
    try:
        args = ["--redis-sentinel", ha.sentinel_arg, "--redis-min-replicas", "1"]
        yield ha.primary(), args, ha
    finally:
        ha.close()


def refuse_writes(raw: redis_lib.Redis, refusal: str, ha: RedisHA | None) -> Callable[[], None]:
    """Make Redis refuse writes (or, "stalled", leave its replicas silent); returns the undo."""
    if refusal == "readonly":
        raw.replicaof("127.0.0.1", 1)  # nothing listens on port 1: stays a lone replica
        return lambda: raw.replicaof("NO", "ONE")
    if refusal == "noreplicas":
        raw.config_set("min-replicas-to-write", 3)  # more replicas than there are
        return lambda: raw.config_set("min-replicas-to-write", 0)
    assert ha is not None  # "stalled": writes succeed, no replica acknowledges them
    stalled = ha.replicas()
    for node in stalled:
        ha.pause(node)
    return lambda: [ha.resume(node) for node in stalled]


@pytest.mark.parametrize(
    ("topology", "refusal"),
    [("single", "readonly"), ("single", "noreplicas"),
     ("ha", "readonly"), ("ha", "noreplicas"), ("ha", "stalled")],
)  # fmt: skip
def test_streams_pause_while_redis_refuses_writes_and_lose_nothing(tmp_path, topology, refusal):
    """Redis that answers but refuses writes (READONLY, NOREPLICAS; OOM and MISCONF take the
    same path), or, with replicas, whose replicas acknowledge nothing: streams pause, new
    requests get UNAVAILABLE, health says NOT_SERVING, and everything continues once Redis
    takes writes again, nothing lost, nothing crashed. With Sentinel a READONLY primary is also
    a reason to ask the Sentinels again (they still name it: it is retried)."""
    with redis_topology(tmp_path, topology) as (primary, redis_args, ha):
        stack = make_stack(
            tmp_path, primary, scheduler_args=["--max-backlog-steps", "4", *redis_args]
        )
        try:
            reqs = mixed_workload(refusal, 8, 120, rng_seed=3)
            reference = reference_run(stack.address, reqs)
            channel, stub = stub_for(stack.address)
            results, threads = stream_in_threads(stub, reqs, min_tokens=2)
            raw = redis_lib.Redis(host="127.0.0.1", port=primary.port)
            undo = refuse_writes(raw, refusal, ha)
            time.sleep(0.5)  # writes in flight when writes stopped have failed by now
            seen = [len(r.tokens.get(0, [])) for r in results]
            time.sleep(1.5)
            assert [len(r.tokens.get(0, [])) for r in results] == seen, "streams ran ahead of Redis"
            res = generate(stub, [4, 5, 6], max_tokens=2)
            assert res.error is not None and res.error.code() == grpc.StatusCode.UNAVAILABLE
            assert health(stack.address) == NOT_SERVING
            time.sleep(2.0)  # a while longer: the writer keeps retrying, it does not die
            undo()
            for t in threads:
                t.join(timeout=120)
            for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
                assert_same(got, ref, f"stream {i}")
                key = f"llmserve:tokens:{reqs[i].request_id}:0"
                assert [int(t) for t in raw.lrange(key, 0, -1)] == got.tokens[0]
            wait_health(stack.address, SERVING, timeout=10)
            assert generate(stub, [4, 5, 6], max_tokens=2).error is None
            raw.close()
            channel.close()
            assert "Traceback" not in (tmp_path / "scheduler.log").read_text()
        finally:
            stack.stop()


# ---------------------------------------------------------------- a step that raises


def run_through_a_crash(
    tmp_path, redis, monkeypatch, failpoint: str, prefix: str, rng_seed: int
) -> tuple[list[Collected], list[Collected], list[int]]:
    """Six requests while `failpoint` raises once, on the 21st step (inside this run), then the
    same requests undisturbed. Returns both runs and the stored status of each request."""
    monkeypatch.setenv("LLMSERVE_FAILPOINTS", f"{failpoint}=1@20")
    stack = make_stack(tmp_path, redis)
    try:
        reqs = mixed_workload(prefix, 6, 60, rng_seed=rng_seed)
        channel, stub = stub_for(stack.address)
        results = run_in_threads([lambda r=r: collect(stub.Generate(r, timeout=120)) for r in reqs])
        reference = reference_run(stack.address, reqs)  # and the loop still serves
        states = [
            stub.GetRequest(pb.GetRequestRequest(request_id=r.request_id)).status for r in reqs
        ]
        channel.close()
    finally:
        stack.stop()
    log = (tmp_path / "scheduler.log").read_text()
    assert log.count("engine.step_crashed") == 1 and log.count("Traceback") == 1, log
    return results, reference, states


def test_a_step_that_cannot_be_planned_is_retried_by_recompute(tmp_path, redis, monkeypatch):
    results, reference, _ = run_through_a_crash(
        tmp_path, redis, monkeypatch, "engine.schedule", "plan", rng_seed=4
    )
    for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
        assert_same(got, ref, f"request {i}")


def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on(tmp_path, redis, monkeypatch):
    results, reference, states = run_through_a_crash(
        tmp_path, redis, monkeypatch, "engine.process_step", "proc", rng_seed=6
    )
    failed = 0
    for got, ref in zip(results, reference, strict=True):
        assert got.error is None and got.offsets_ok
        if got.finish[0] == pb.FINISH_REASON_ERROR:
            failed += 1
            # What it had streamed is exactly what an undisturbed run produced so far.
            assert got.tokens[0] == ref.tokens[0][: len(got.tokens[0])]
        else:
            assert got.tokens[0] == ref.tokens[0]
    assert failed >= 1
    assert states == [pb.REQUEST_STATUS_FINISHED] * len(results)


# ---------------------------------------------------------------- executors that come back


def test_executor_back_with_another_cache_shape_gets_a_fresh_core(tmp_path, redis):
    stack = make_stack(tmp_path, redis)
    try:
        reqs = mixed_workload("shape", 6, 80, rng_seed=8, max_prompt_len=40)
        reference = reference_run(stack.address, reqs)
        channel, stub = stub_for(stack.address)
        results, threads = stream_in_threads(stub, reqs, min_tokens=3)
        stack.executor_proc.kill()
        stack.executor_proc.wait()
        # Far fewer, smaller blocks: the old block tables point past the end of this cache.
        stack.executor_args = ["--num-device-blocks", "64", "--block-size", "8"]
        stack.start_executor()
        for t in threads:
            t.join(timeout=120)
        for i, (got, ref) in enumerate(zip(results, reference, strict=True)):
            assert_same(got, ref, f"request {i}")
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.executors[0].num_device_blocks == 64 and info.block_size == 8
        assert info.executors[0].healthy
        channel.close()
    finally:
        stack.stop()


def test_executor_restarted_while_idle_never_serves_a_stale_prefix(tmp_path, redis):
    """The scheduler's prefix cache remembers blocks of the executor's old life. Health probes
    are slowed down here so that only the step's instance check can notice the restart."""
    stack = make_stack(tmp_path, redis, scheduler_args=["--health-interval", "600"])
    try:
        channel, stub = stub_for(stack.address)
        prompt = list(range(10, 60))  # three full blocks of 16: cached after the first run
        first = generate(stub, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert first.error is None
        stack.executor_proc.kill()
        stack.executor_proc.wait()
        stack.start_executor()
        again = generate(stub, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert again.error is None and again.tokens == first.tokens
        log = (tmp_path / "scheduler.log").read_text()
        assert "FAILED_PRECONDITION" in log  # the fence, not luck, caught it
        channel.close()
    finally:
        stack.stop()
