"""Garbage gets a clean status: malformed bytes on any RPC, unknown chat roles, a fuzz run.

Real processes (the `llmserve_stack` fixture: Redis, executor, scheduler). Raw bytes go out
through the channel's generic calls, so nothing on the client side parses or validates them.
"""

from __future__ import annotations

import time

import grpc
import pytest

from benchmarks.fuzz_scheduler import report, run_fuzz
from protos import scheduler_pb2 as pb
from tests.support.api_helpers import collect, stub_for

GARBAGE = b"\xff\xff\xff\xff\x0f"  # a varint that never ends: no message parses from it

METHODS = [
    ("/llmserve.v1.Scheduler/Generate", "us"),
    ("/llmserve.v1.Scheduler/Resume", "us"),
    ("/llmserve.v1.Scheduler/Abort", "uu"),
    ("/llmserve.v1.Scheduler/GetRequest", "uu"),
    ("/llmserve.v1.Scheduler/GetServerInfo", "uu"),
    ("/grpc.health.v1.Health/Check", "uu"),
    ("/grpc.health.v1.Health/Watch", "us"),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "ss"),
]


def send_raw(channel: grpc.Channel, method: str, kind: str, payload: bytes) -> grpc.StatusCode:
    try:
        if kind == "uu":
            channel.unary_unary(method)(payload, timeout=10)
        elif kind == "us":
            list(channel.unary_stream(method)(payload, timeout=10))
        else:
            list(channel.stream_stream(method)(iter([payload]), timeout=10))
    except grpc.RpcError as e:
        assert "not a valid protobuf message" in e.details(), e.details()
        return e.code()
    return grpc.StatusCode.OK


def scheduler_log(stack) -> str:
    return (stack.workdir / "scheduler.log").read_text(errors="replace")


@pytest.mark.parametrize(("method", "kind"), METHODS, ids=[m.rsplit("/", 1)[1] for m, _ in METHODS])
def test_malformed_bytes_get_invalid_argument_on_every_method(llmserve_stack, method, kind):
    with grpc.insecure_channel(llmserve_stack.address) as channel:
        assert send_raw(channel, method, kind, GARBAGE) == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in scheduler_log(llmserve_stack)


def test_a_flood_of_garbage_leaves_a_bounded_log(llmserve_stack):
    def lines() -> int:
        return scheduler_log(llmserve_stack).count("rpc.malformed_request")

    before = lines()
    t0 = time.monotonic()
    with grpc.insecure_channel(llmserve_stack.address) as channel:
        call = channel.unary_unary("/llmserve.v1.Scheduler/GetServerInfo")
        for _ in range(2000):
            with pytest.raises(grpc.RpcError) as e:
                call(GARBAGE, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    elapsed = time.monotonic() - t0
    time.sleep(0.2)
    logged = lines() - before
    # At most 10 lines a second (plus the initial burst), however many messages came.
    assert 1 <= logged <= 10 + 10 * elapsed + 1, (logged, elapsed)
    assert "num_suppressed" in scheduler_log(llmserve_stack) or logged == 2000


@pytest.mark.parametrize("role", ["root", "", "USER", "function-call"])
def test_chat_messages_with_an_unknown_role_are_invalid(llmserve_stack, role):
    channel, stub = stub_for(llmserve_stack.address)
    req = pb.GenerateRequest(params=pb.SamplingParams(max_tokens=2))
    req.chat.messages.add(role="user", content="hi")
    req.chat.messages.add(role=role, content="do as I say")
    res = collect(stub.Generate(req, timeout=30))
    channel.close()
    assert res.error is not None and res.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt.chat.messages[1].role" in res.error.details()


def test_fuzz_run_ends_clean(llmserve_stack):
    """3 000 hostile messages: no UNKNOWN or INTERNAL, no error finish, no traceback, nothing
    left running, and the scheduler still serves (the same checks as the 10 000-message run
    of benchmarks/fuzz_scheduler.py)."""
    result = run_fuzz(
        llmserve_stack.address,
        messages=3000,
        seed=7,
        time_limit_s=120,
        log_file=llmserve_stack.workdir / "scheduler.log",
    )
    assert result.ok, report(result, 0.0)
    assert result.num_messages == 3000
