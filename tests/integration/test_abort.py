"""Abort wins every race with its Generate and is final when it answers (issue 27).

Real Redis, a real executor and a real scheduler process. Four sequence slots, so that some
requests wait while others run and aborts meet requests in every state.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    Collected,
    collect,
    gen_request,
    stub_for,
    wait_until_idle,
)
from tests.support.stack import make_stack

MAX_NUM_SEQS = 4
LONG = 100_000  # max_tokens (with ignore_eos) of a request only an abort ends in a test


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("abort")
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    s = make_stack(tmp, redis, scheduler_args=["--max-num-seqs", str(MAX_NUM_SEQS)])
    yield s
    s.stop()
    redis.close()


@pytest.fixture
def api(stack):
    channel, stub = stub_for(stack.address)
    yield stub
    channel.close()


def _state(api, rid: str) -> pb.GetRequestResponse:
    return api.GetRequest(pb.GetRequestRequest(request_id=rid))


def _wait_status(api, rid: str, status: int, timeout: float = 30.0) -> pb.GetRequestResponse:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = _state(api, rid)
            if state.status == status and (
                status != pb.REQUEST_STATUS_RUNNING or state.sequences[0].token_ids
            ):
                return state
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        time.sleep(0.02)
    raise AssertionError(f"{rid} never reached status {status}")


def _assert_aborted_now(api, rid: str) -> None:
    """What every read must show the moment an Abort of `rid` has answered."""
    state = _state(api, rid)
    assert state.status == pb.REQUEST_STATUS_FINISHED, pb.RequestStatus.Name(state.status)
    assert [s.finish_reason for s in state.sequences] == [pb.FINISH_REASON_ABORT]
    resumed = collect(api.Resume(pb.ResumeRequest(request_id=rid), timeout=10))
    assert resumed.error is None
    assert resumed.finish == {0: pb.FINISH_REASON_ABORT}
    assert resumed.tokens[0] == list(state.sequences[0].token_ids)


def test_abort_before_generate_wins(api):
    reply = api.Abort(pb.AbortRequest(request_id="early"))
    assert not reply.aborted and reply.pending  # nothing ran; the abort waits for the id
    t0 = time.monotonic()
    got = collect(
        api.Generate(gen_request([5, 6, 7], request_id="early", max_tokens=LONG, ignore_eos=True))
    )
    assert got.error is None
    assert got.finish == {0: pb.FINISH_REASON_ABORT}
    assert got.tokens.get(0, []) == []  # no token was ever generated
    assert time.monotonic() - t0 < 5
    _assert_aborted_now(api, "early")
    # The id is taken by the aborted request: sending it again attaches, never generates.
    again = collect(
        api.Generate(gen_request([5, 6, 7], request_id="early", max_tokens=LONG, ignore_eos=True))
    )
    assert again.finish == {0: pb.FINISH_REASON_ABORT} and again.tokens.get(0, []) == []
    reply = api.Abort(pb.AbortRequest(request_id="early"))
    assert not reply.aborted and not reply.pending  # it exists now, finished
    assert wait_until_idle(api).num_running == 0


@pytest.mark.parametrize("round_", range(5))  # the race is one of timing: try it often
def test_get_request_right_after_abort_is_final(api, round_):
    """For a running request and for a waiting one (every slot taken by others)."""
    runners = [f"slot-{round_}-{i}" for i in range(MAX_NUM_SEQS)]
    for rid in runners:
        next(
            api.Generate(
                gen_request(
                    [7, 8, 9], request_id=rid, max_tokens=LONG, ignore_eos=True, detached=True
                )
            )
        )
    for rid in runners:
        _wait_status(api, rid, pb.REQUEST_STATUS_RUNNING)
    waiting = f"queued-{round_}"
    call = api.Generate(
        gen_request([3, 4], request_id=waiting, max_tokens=LONG, ignore_eos=True, detached=True)
    )
    _wait_status(api, waiting, pb.REQUEST_STATUS_WAITING)
    assert api.Abort(pb.AbortRequest(request_id=waiting)).aborted
    _assert_aborted_now(api, waiting)
    assert collect(call).finish == {0: pb.FINISH_REASON_ABORT}
    for rid in runners:  # each while the others still run, mid-step
        reply = api.Abort(pb.AbortRequest(request_id=rid))
        assert reply.aborted, (reply, _state(api, rid))
        _assert_aborted_now(api, rid)
    assert wait_until_idle(api).kv_cache_usage == 0.0


def test_abort_storm_never_loses_a_race(api, stack):
    """Generate and Abort of the same id, each after its own random 0-0.5 s delay: every
    request ends aborted, or (Generate first, and finished first) normally with the abort
    saying so; none runs on after an abort that answered, and nothing is left running."""
    rng = random.Random(27)
    num = 200
    ids = [f"storm-{i}" for i in range(num)]
    max_tokens = [rng.choice([2, LONG]) for _ in range(num)]
    delays = [(rng.uniform(0, 0.5), rng.uniform(0, 0.5)) for _ in range(num)]
    streams = [Collected() for _ in range(num)]
    replies: list[pb.AbortResponse | grpc.RpcError | None] = [None] * num
    start = threading.Event()
    channel, other = stub_for(stack.address)  # aborts come from another client

    def generate(i: int) -> None:
        start.wait()
        time.sleep(delays[i][0])
        req = gen_request([9, 10, 11], request_id=ids[i], max_tokens=max_tokens[i], ignore_eos=True)
        collect(api.Generate(req, timeout=120), streams[i])

    def abort(i: int) -> None:
        start.wait()
        time.sleep(delays[i][1])
        try:
            replies[i] = other.Abort(pb.AbortRequest(request_id=ids[i]), timeout=60)
        except grpc.RpcError as e:
            replies[i] = e

    threads = [threading.Thread(target=f, args=(i,)) for i in range(num) for f in (generate, abort)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    start.set()
    for t in threads:
        t.join(timeout=180)
    elapsed = time.monotonic() - t0
    channel.close()
    assert not any(t.is_alive() for t in threads)
    assert elapsed < 120  # bounded: no stream ran to its 100k tokens

    outcomes = {"aborted": 0, "pending": 0, "finished first": 0}
    for i, rid in enumerate(ids):
        reply, got = replies[i], streams[i]
        assert isinstance(reply, pb.AbortResponse), f"{rid}: {reply}"
        assert got.error is None, f"{rid}: {got.error}"
        state = _state(api, rid)
        assert state.status == pb.REQUEST_STATUS_FINISHED
        assert list(state.sequences[0].token_ids) == got.tokens.get(0, [])
        assert state.sequences[0].finish_reason == got.finish[0]
        if reply.aborted or reply.pending:
            assert got.finish[0] == pb.FINISH_REASON_ABORT, rid
            if reply.pending:
                assert got.tokens.get(0, []) == [], rid  # aborted before it began
            outcomes["pending" if reply.pending else "aborted"] += 1
        else:
            # Not active when the abort came: only a request that had finished on its own.
            assert max_tokens[i] == 2 and got.finish[0] == pb.FINISH_REASON_LENGTH, rid
            outcomes["finished first"] += 1
    print(outcomes)
    assert outcomes["aborted"] and outcomes["pending"]  # both races really happened
    info = wait_until_idle(api)
    assert info.num_running == info.num_waiting == 0 and info.kv_cache_usage == 0.0


def test_abort_ahead_survives_a_scheduler_kill_9(stack):
    channel, api = stub_for(stack.address)
    reply = api.Abort(pb.AbortRequest(request_id="ghost"))
    assert reply.pending
    channel.close()
    stack.kill_scheduler()
    stack.start_scheduler()
    channel, api = stub_for(stack.address)
    try:
        t0 = time.monotonic()
        got = collect(
            api.Generate(
                gen_request([1, 2, 3], request_id="ghost", max_tokens=LONG, ignore_eos=True)
            )
        )
        assert got.error is None
        assert got.finish == {0: pb.FINISH_REASON_ABORT} and got.tokens.get(0, []) == []
        assert time.monotonic() - t0 < 5
        _assert_aborted_now(api, "ghost")
        info = wait_until_idle(api)
        assert info.num_running == info.num_waiting == 0
    finally:
        channel.close()
