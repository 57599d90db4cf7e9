"""The admin MoveRequest (issue 47): a running request moves with its KV cache to the executor
named (address or instance id) and continues there with byte-identical output (greedy and
seeded, moved there and back); clear statuses when it cannot.

Real processes: Redis, executors A and B, the scheduler, the tiny demo model. B is paused
(SIGSTOP) until the health probe marks it down, so that the reference and the streams run on A;
it comes back idle before the moves.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    collect,
    gen_request,
    mixed_workload,
    run_in_threads,
    stream_in_threads,
    stub_for,
)
from tests.support.prom import free_port, scrape, total
from tests.support.stack import start_two_executor_stack

MAX_TOKENS = 480
NUM_STREAMS = 32  # enough to keep the steps slow while B comes back; 4 of them move
EXECUTOR_ARGS = ["--num-device-blocks", "512", "--swap-space", "0.01"]


def _executors(stub) -> dict[str, pb.ExecutorInfo]:
    return {e.address: e for e in stub.GetServerInfo(pb.GetServerInfoRequest()).executors}


def _wait_healthy(stub, address: str, healthy: bool) -> None:
    deadline = time.monotonic() + 30
    while _executors(stub)[address].healthy != healthy:
        assert time.monotonic() < deadline, f"{address} never became healthy={healthy}"
        time.sleep(0.02)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_move_request_there_and_back_keeps_the_output(tmp_path):
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    port = free_port()
    b_stack, a_stack = start_two_executor_stack(
        tmp_path, redis, EXECUTOR_ARGS, scheduler_args=["--metrics-port", str(port)]
    )
    a, b = a_stack.executor_address, b_stack.executor_address
    channel, stub = stub_for(b_stack.address)
    try:
        b_stack.executor_proc.send_signal(signal.SIGSTOP)
        _wait_healthy(stub, b, healthy=False)
        reqs = mixed_workload("ref", NUM_STREAMS, MAX_TOKENS, rng_seed=3, max_prompt_len=24)
        reference = run_in_threads([lambda r=r: collect(stub.Generate(r)) for r in reqs])
        reqs = mixed_workload("mv", NUM_STREAMS, MAX_TOKENS, rng_seed=3, max_prompt_len=24)
        twin = gen_request([7, 8, 9], request_id="twin", n=2, max_tokens=MAX_TOKENS,
                           temperature=0.8, seed=1, ignore_eos=True)  # fmt: skip
        results, threads = stream_in_threads(stub, [*reqs, twin])
        b_stack.executor_proc.send_signal(signal.SIGCONT)
        _wait_healthy(stub, b, healthy=True)
        a_instance = _executors(stub)[a].instance_id

        def move(req_id: str, to: str) -> pb.MoveRequestResponse:
            return stub.MoveRequest(pb.MoveRequestRequest(request_id=req_id, to_executor=to))

        assert max(len(r.tokens[0]) for r in results[:4]) < MAX_TOKENS - 50, "too late to move"
        for r in reqs[:4]:
            assert move(r.request_id, b) == pb.MoveRequestResponse(from_executor=a, to_executor=b)
        # Back to A, named by its instance id, for half of them.
        for r in reqs[:2]:
            assert move(r.request_id, a_instance).to_executor == a
        assert _code(lambda: move("nobody", b)) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: move(reqs[3].request_id, "127.0.0.1:1")) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        assert _code(lambda: move(reqs[3].request_id, b)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: move("twin", b)) == grpc.StatusCode.FAILED_PRECONDITION  # n = 2
        for t in threads:
            t.join(timeout=120)
        for i, (got, ref) in enumerate(zip(results, reference, strict=False)):
            assert got.error is None and got.offsets_ok, i
            assert got.tokens[0] == ref.tokens[0], i
        assert total(scrape(port), "llmserve:prompt_tokens_recomputed_total") == 0
    except BaseException:
        print(b_stack.logs(), a_stack.logs())
        raise
    finally:
        channel.close()
        b_stack.executor_proc.send_signal(signal.SIGCONT)
        b_stack.stop()
        a_stack.stop()
        redis.close()
