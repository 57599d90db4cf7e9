"""Nothing lost: kill -9 of the scheduler, Redis restarts, resume, attach, TTL, outages.

Real processes throughout: a Redis server with append-only persistence, an executor process and
a scheduler process that the tests kill and restart.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import redis as redis_lib

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    Collected,
    collect,
    gen_request,
    generate,
    mixed_workload,
    run_in_threads,
    stub_for,
)
from tests.support.stack import make_stack

NUM_CLIENTS = 20
MAX_TOKENS = 120


@pytest.fixture
def stack(tmp_path):
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    # A small write backlog: during a Redis outage the engine must pause, not run ahead.
    s = make_stack(
        tmp_path, redis, scheduler_args=["--finished-ttl", "600", "--max-backlog-steps", "4"]
    )
    yield s
    s.stop()
    redis.close()


def workload(prefix: str) -> list[pb.GenerateRequest]:
    return mixed_workload(prefix, NUM_CLIENTS, MAX_TOKENS, rng_seed=5)


def test_kill_9_scheduler_mid_generation_loses_nothing(stack):
    channel, stub = stub_for(stack.address)
    # The undisturbed run, for comparison.
    reference = run_in_threads([lambda r=r: collect(stub.Generate(r)) for r in workload("ref")])
    channel.close()
    assert all(r.error is None and len(r.tokens[0]) == MAX_TOKENS for r in reference)

    collected = [Collected() for _ in range(NUM_CLIENTS)]
    started = threading.Barrier(NUM_CLIENTS + 1)
    killed = threading.Event()

    def client(i: int, req: pb.GenerateRequest) -> None:
        ch, st = stub_for(stack.address)
        stream = st.Generate(req)
        passed = False
        try:
            for msg in stream:
                collected[i].add(msg)
                if not passed and len(collected[i].tokens.get(0, [])) >= 3:
                    passed = True
                    started.wait(timeout=60)
        except grpc.RpcError as e:
            collected[i].error = e
        if not passed:
            started.wait(timeout=60)
        ch.close()
        killed.wait(timeout=120)
        # Re-attach by id from the last index received, retrying while the scheduler restarts.
        deadline = time.monotonic() + 120
        while 0 not in collected[i].finish and time.monotonic() < deadline:
            ch, st = stub_for(stack.address)
            got = len(collected[i].tokens.get(0, []))
            try:
                for msg in st.Resume(
                    pb.ResumeRequest(request_id=req.request_id, from_token_index=got),
                    timeout=60,
                ):
                    collected[i].add(msg)
            except grpc.RpcError:
                time.sleep(0.2)
            finally:
                ch.close()

    threads = [threading.Thread(target=client, args=(i, r)) for i, r in enumerate(workload("run"))]
    for t in threads:
        t.start()
    started.wait(timeout=120)  # every client is mid-generation
    stack.kill_scheduler()
    mid = [len(c.tokens.get(0, [])) for c in collected]
    stack.start_scheduler()
    killed.set()
    for t in threads:
        t.join(timeout=180)

    assert sum(1 for m in mid if 0 < m < MAX_TOKENS) >= NUM_CLIENTS // 2, mid
    for i, (got, ref) in enumerate(zip(collected, reference, strict=True)):
        assert got.offsets_ok, f"client {i} saw a gap or a repeat"
        assert got.finish.get(0) == pb.FINISH_REASON_LENGTH, f"client {i} did not finish"
        assert got.tokens[0] == ref.tokens[0], f"client {i} output differs from undisturbed run"
        assert got.text[0] == ref.text[0]


def test_redis_restart_during_generation_loses_no_acknowledged_token(stack):
    channel, stub = stub_for(stack.address)
    reqs = workload("redis")[:8]
    results: list[Collected] = [Collected() for _ in reqs]
    threads = [
        threading.Thread(target=lambda i=i, r=r: collect(stub.Generate(r), results[i]))
        for i, r in enumerate(reqs)
    ]
    for t in threads:
        t.start()
    while min(len(r.tokens.get(0, [])) for r in results) < 2:
        time.sleep(0.01)
    stack.redis.stop(kill=True)
    time.sleep(0.5)  # writes in flight at the kill have failed by now
    seen = [len(r.tokens.get(0, [])) for r in results]
    time.sleep(1.0)
    # Nothing unacknowledged reaches a client: streams pause while Redis is down.
    assert [len(r.tokens.get(0, [])) for r in results] == seen
    stack.redis.start()
    for t in threads:
        t.join(timeout=120)
    raw = redis_lib.Redis.from_url(stack.redis.url)
    for req, res in zip(reqs, results, strict=True):
        assert res.error is None, res.error
        assert res.offsets_ok
        assert len(res.tokens[0]) == MAX_TOKENS
        stored = [int(t) for t in raw.lrange(f"llmserve:tokens:{req.request_id}:0", 0, -1)]
        assert stored == res.tokens[0]  # every token a client saw is in Redis
    channel.close()


def test_unavailable_while_redis_down_then_recovers(stack):
    channel, stub = stub_for(stack.address)
    stack.redis.stop()
    try:
        deadline = time.monotonic() + 20
        while True:
            res = generate(stub, [1, 2, 3], max_tokens=4)
            if res.error is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert res.error is not None
        assert res.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in res.error.details()
    finally:
        stack.redis.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        res = generate(stub, [1, 2, 3], max_tokens=4, temperature=0.0)
        if res.error is None:
            break
        time.sleep(0.2)
    assert res.error is None and len(res.tokens[0]) == 4
    channel.close()


def test_resume_from_offset_attach_by_duplicate_id_and_get_request(stack):
    channel, stub = stub_for(stack.address)
    full = generate(stub, [3, 4, 5, 6], request_id="r-1", max_tokens=20, temperature=0.0)
    assert full.error is None and len(full.tokens[0]) == 20
    tail = collect(stub.Resume(pb.ResumeRequest(request_id="r-1", from_token_index=15)))
    assert tail.error is None
    assert tail.tokens[0] == full.tokens[0][15:]
    assert tail.finish[0] == pb.FINISH_REASON_LENGTH
    # Attaching with the same id (even with other params) replays, never regenerates.
    dup = generate(stub, [9, 9], request_id="r-1", max_tokens=3, temperature=1.0)
    assert dup.tokens == full.tokens
    state = stub.GetRequest(pb.GetRequestRequest(request_id="r-1"))
    assert state.status == pb.REQUEST_STATUS_FINISHED
    assert list(state.sequences[0].token_ids) == full.tokens[0]
    assert state.sequences[0].text == full.text[0]
    assert list(state.prompt_token_ids) == [3, 4, 5, 6]

    # Attach to a request that is still running: the second stream sees the same tokens.
    first = stub.Generate(gen_request([7, 7, 7], request_id="live", max_tokens=60, ignore_eos=True))
    a = Collected()
    for msg in first:
        a.add(msg)
        break
    b = collect(stub.Generate(gen_request([1], request_id="live", max_tokens=5)))
    collect(first, a)
    assert a.tokens == b.tokens and len(a.tokens[0]) == 60
    channel.close()


def test_finished_requests_expire_after_ttl(tmp_path):
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    stack = make_stack(tmp_path, redis, scheduler_args=["--finished-ttl", "1"])
    try:
        channel, stub = stub_for(stack.address)
        assert generate(stub, [1, 2], request_id="short-lived", max_tokens=2).error is None
        assert stub.GetRequest(pb.GetRequestRequest(request_id="short-lived")).request_id
        time.sleep(1.5)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetRequest(pb.GetRequestRequest(request_id="short-lived"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        channel.close()
    finally:
        stack.stop()
        redis.close()


def test_executor_restart_mid_generation_recomputes_and_finishes(stack):
    """An executor that dies loses its KV cache; the scheduler recomputes on the new one."""
    channel, stub = stub_for(stack.address)
    reqs = workload("exec")[:6]
    reference = run_in_threads([lambda r=r: collect(stub.Generate(r)) for r in reqs])
    results: list[Collected] = [Collected() for _ in reqs]
    rerun = [
        gen_request(
            list(r.token_ids.ids),
            request_id=r.request_id + "-b",
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            temperature=r.params.temperature,
            **({"seed": r.params.seed} if r.params.HasField("seed") else {}),
        )
        for r in reqs
    ]
    threads = [
        threading.Thread(target=lambda i=i, r=r: collect(stub.Generate(r), results[i]))
        for i, r in enumerate(rerun)
    ]
    for t in threads:
        t.start()
    while min(len(r.tokens.get(0, [])) for r in results) < 3:
        time.sleep(0.01)
    stack.executor_proc.kill()
    stack.executor_proc.wait()
    stack.start_executor()  # same port, new instance id, empty KV cache
    for t in threads:
        t.join(timeout=120)
    for got, ref in zip(results, reference, strict=True):
        assert got.error is None, got.error
        assert got.offsets_ok
        assert got.tokens[0] == ref.tokens[0]
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.executors[0].healthy
    channel.close()
