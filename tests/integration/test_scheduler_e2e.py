"""The scheduler end to end: real Redis, a real executor process, a real scheduler process."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_svc.kernels import library
from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    Collected,
    collect,
    gen_request,
    generate,
    hf_greedy,
    run_in_threads,
    stub_for,
    wait_until_idle,
)
from tests.support.stack import make_stack

MAX_TOKENS = 10


def make_prompts(num: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


@pytest.fixture(scope="module")
def api(llmserve_stack):
    channel, stub = stub_for(llmserve_stack.address)
    yield stub
    channel.close()


@pytest.fixture(scope="module")
def reference(llmserve_stack):
    prompts = make_prompts(10)
    return prompts, hf_greedy(llmserve_stack.model_dir, prompts, MAX_TOKENS)


def test_greedy_batch_equals_hf(api, reference):
    prompts, expected = reference
    results = run_in_threads(
        [
            lambda p=p: generate(api, p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            for p in prompts
        ]
    )
    for res, exp in zip(results, expected, strict=True):
        assert res.error is None, res.error
        assert res.offsets_ok
        assert res.tokens[0] == exp
        assert res.finish[0] == pb.FINISH_REASON_LENGTH


def test_text_prompt_and_streamed_text(api):
    res = collect(
        api.Generate(gen_request(text="The cat sat on", max_tokens=8, temperature=0.0), timeout=60)
    )
    assert res.error is None
    assert len(res.tokens[0]) >= 1
    assert res.finish[0] in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert "\ufffd" not in res.text[0]  # only complete characters are streamed


def test_short_request_after_long_one_finishes_first(api):
    """Continuous batching: a short request joins a running long one and finishes first."""
    long = Collected()
    stream = api.Generate(
        gen_request([11, 12, 13, 14], request_id="long", max_tokens=5000, ignore_eos=True),
        timeout=120,
    )
    reader = threading.Thread(target=collect, args=(stream, long))
    reader.start()
    deadline = time.monotonic() + 60
    while len(long.tokens.get(0, [])) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)  # the long request is decoding
    short = generate(api, [21, 22, 23], max_tokens=3, temperature=0.0, ignore_eos=True)
    long_tokens_then = len(long.tokens.get(0, []))
    assert short.finish[0] == pb.FINISH_REASON_LENGTH and len(short.tokens[0]) == 3
    assert 3 <= long_tokens_then < 5000 and 0 not in long.finish  # still running
    api.Abort(pb.AbortRequest(request_id="long"))
    reader.join(timeout=60)
    assert long.finish[0] == pb.FINISH_REASON_ABORT


def test_n_with_seed_is_reproducible(api):
    params = dict(max_tokens=12, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    a = generate(api, [7, 8, 9, 10, 11], **params)
    b = generate(api, [7, 8, 9, 10, 11], **params)
    assert a.error is None and b.error is None
    assert a.offsets_ok and b.offsets_ok
    assert sorted(a.tokens) == [0, 1, 2]
    assert a.tokens == b.tokens
    assert len({tuple(t) for t in a.tokens.values()}) > 1  # the n samples differ


def test_abort_mid_stream_returns_blocks(llmserve_stack, api):
    stream = api.Generate(
        gen_request([5, 6, 7], request_id="to-abort", max_tokens=400, ignore_eos=True),
        timeout=60,
    )
    got = Collected()
    for msg in stream:
        got.add(msg)
        if len(got.tokens.get(0, [])) >= 2:
            channel, other = stub_for(llmserve_stack.address)  # a different client aborts
            assert other.Abort(pb.AbortRequest(request_id="to-abort")).aborted
            channel.close()
            break
    collect(stream, got)
    assert got.finish[0] == pb.FINISH_REASON_ABORT
    assert len(got.tokens[0]) < 400
    assert wait_until_idle(api).kv_cache_usage == 0.0
    state = api.GetRequest(pb.GetRequestRequest(request_id="to-abort"))
    assert state.status == pb.REQUEST_STATUS_FINISHED
    assert state.sequences[0].finish_reason == pb.FINISH_REASON_ABORT


def test_cancelled_call_aborts_unless_detached(api):
    for detached in (False, True):
        rid = f"cancel-{detached}"
        call = api.Generate(
            gen_request([5, 6], request_id=rid, max_tokens=300, ignore_eos=True, detached=detached)
        )
        next(iter(call))
        call.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = api.GetRequest(pb.GetRequestRequest(request_id=rid))
            if state.status == pb.REQUEST_STATUS_FINISHED:
                break
            time.sleep(0.05)
        reason = state.sequences[0].finish_reason
        if detached:
            assert reason == pb.FINISH_REASON_LENGTH and len(state.sequences[0].token_ids) == 300
        else:
            assert reason == pb.FINISH_REASON_ABORT


def test_same_request_id_never_generates_twice(api):
    first = generate(api, [9, 9, 9], request_id="dup", max_tokens=6, temperature=1.0)
    again = generate(api, [1, 2, 3], request_id="dup", max_tokens=50, temperature=1.0)
    assert again.tokens == first.tokens  # attached to the stored request, same output


def test_server_info_and_health(llmserve_stack, api):
    info = api.GetServerInfo(pb.GetServerInfoRequest())
    assert info.model and info.max_model_len > 0 and info.block_size > 0
    assert len(info.executors) == 1 and info.executors[0].healthy
    # The suite pins `--dtype auto` to fp32 (tests/conftest.py); the kernel variant is the best
    # one this CPU runs, or the one $LLMSERVE_CPU_ISA forces (a run of the suite on the avx2
    # kernels of an AVX-512 machine), as the executor process logged it (cpu_kernel.variant).
    assert info.executors[0].dtype == "float32"
    assert info.executors[0].cpu_kernel_isa in ("", library._pick()[0])
    with grpc.insecure_channel(llmserve_stack.address) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert r.status == health_pb2.HealthCheckResponse.SERVING


INVALID = [
    ("empty prompt", gen_request([]), "prompt"),
    ("empty text", gen_request(text=""), "prompt"),
    ("too long", gen_request([7] * 600), "maximum model length"),
    # max_tokens=0 is a prompt-only request (scoring); min_tokens may not exceed it.
    ("max_tokens", gen_request([1, 2], max_tokens=0, min_tokens=1), "max_tokens"),
    ("n", gen_request([1, 2], n=0), "params.n"),
    ("temperature", gen_request([1, 2], temperature=-1), "temperature"),
    ("top_p", gen_request([1, 2], top_p=1.5), "top_p"),
    ("top_k", gen_request([1, 2], top_k=-2), "top_k"),
    ("min_p", gen_request([1, 2], min_p=2), "min_p"),
    ("presence", gen_request([1, 2], presence_penalty=3), "presence_penalty"),
    ("frequency", gen_request([1, 2], frequency_penalty=-3), "frequency_penalty"),
    ("repetition", gen_request([1, 2], repetition_penalty=0), "repetition_penalty"),
    ("logprobs", gen_request([1, 2], logprobs=1000), "logprobs"),
    ("stop count", gen_request([1, 2], stop=["x"] * 100), "stop"),
    ("stop length", gen_request([1, 2], stop=["x" * 1000]), "stop"),
    ("token id", gen_request([1, 10**6]), "vocabulary"),
    ("stop token id", gen_request([1, 2], stop_token_ids=[10**6]), "stop_token_ids"),
]


@pytest.mark.parametrize(("case", "request_msg", "needle"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_requests(api, case, request_msg, needle):
    res = collect(api.Generate(request_msg, timeout=30))
    assert res.error is not None, case
    assert res.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in res.error.details()


def test_unknown_ids_are_not_found(api):
    for call in (
        lambda: api.GetRequest(pb.GetRequestRequest(request_id="nope")),
        lambda: list(api.Resume(pb.ResumeRequest(request_id="nope"))),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # Abort is the exception: an abort may overtake its own Generate, so an unknown id is
    # not an error but an abort kept for that id (tests/integration/test_abort.py).
    reply = api.Abort(pb.AbortRequest(request_id="nope"))
    assert not reply.aborted and reply.pending


def test_unavailable_without_executor(tmp_path, redis_server):
    """A scheduler whose executor is not up answers UNAVAILABLE, and health is NOT_SERVING."""
    from tests.support.stack import Stack, tiny_model_dir

    stack = Stack(workdir=tmp_path, model_dir=tiny_model_dir(tmp_path / "m"), redis=redis_server)
    stack.executor_port = 1  # nothing listens there
    import subprocess
    import sys

    from tests.support.stack import _env, _wait_port_file

    port_file = tmp_path / "s.port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scheduler_svc",
            "--executor",
            "127.0.0.1:1",
            "--redis-url",
            redis_server.url,
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],  # fmt: skip
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port = _wait_port_file(port_file, proc, 60, "scheduler")
        channel, stub = stub_for(f"127.0.0.1:{port}")
        res = generate(stub, [1, 2, 3])
        assert res.error is not None and res.error.code() == grpc.StatusCode.UNAVAILABLE
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
        channel.close()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_cache_preempts_and_outputs_stay_identical(tmp_path, mode):
    """With a KV cache far too small for all requests at once, outputs still equal HF's."""
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    stack = make_stack(
        tmp_path,
        redis,
        scheduler_args=[
            "--num-device-blocks",
            "14",
            "--preemption-mode",
            mode,
            "--max-num-seqs",
            "8",
        ],  # fmt: skip
    )
    try:
        channel, stub = stub_for(stack.address)
        prompts = make_prompts(8, seed=3, lo=10, hi=30)
        expected = hf_greedy(stack.model_dir, prompts, 24)
        results = run_in_threads(
            [
                lambda p=p: generate(stub, p, max_tokens=24, temperature=0.0, ignore_eos=True)
                for p in prompts
            ]
        )
        for res, exp in zip(results, expected, strict=True):
            assert res.error is None, res.error
            assert res.tokens[0] == exp
        info = stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.num_preemptions > 0
        assert info.kv_cache_usage == 0.0
        channel.close()
    finally:
        stack.stop()
        redis.close()


def test_grpcurl_generates_through_reflection_alone(llmserve_stack):
    """A client with no copy of the protos (grpcurl, Go) discovers the API by reflection."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    listed = subprocess.run(
        [grpcurl, "-plaintext", llmserve_stack.address, "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert "llmserve.v1.Scheduler" in listed.stdout.split()
    body = {
        "request_id": "from-grpcurl",
        "token_ids": {"ids": [5, 6, 7]},
        "params": {"max_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    out = subprocess.run(
        [
            grpcurl,
            "-plaintext",
            "-d",
            json.dumps(body),
            llmserve_stack.address,
            "llmserve.v1.Scheduler/Generate",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    decoder = json.JSONDecoder()
    messages, text = [], out.stdout.strip()
    while text:
        msg, end = decoder.raw_decode(text)
        messages.append(msg)
        text = text[end:].strip()
    # grpcurl prints the proto's field names; other JSON encoders use lowerCamelCase.
    tokens = [t for m in messages for t in m.get("token_ids", m.get("tokenIds", []))]
    assert len(tokens) == 5
    last = messages[-1]
    assert last.get("finish_reason", last.get("finishReason")) == "FINISH_REASON_LENGTH"
    bad = subprocess.run(
        [
            grpcurl,
            "-plaintext",
            "-d",
            '{"token_ids": {"ids": []}}',
            llmserve_stack.address,
            "llmserve.v1.Scheduler/Generate",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0
    assert "InvalidArgument" in bad.stderr and "prompt" in bad.stderr


def test_cancelling_an_attached_call_leaves_the_request_running(api):
    owner = api.Generate(gen_request([4, 4], request_id="shared", max_tokens=80, ignore_eos=True))
    first = Collected()
    for msg in owner:
        first.add(msg)
        break
    attached = api.Generate(gen_request([4, 4], request_id="shared", max_tokens=80))
    next(iter(attached))
    attached.cancel()  # a second caller going away must not abort the owner's request
    collect(owner, first)
    assert first.finish[0] == pb.FINISH_REASON_LENGTH
    assert len(first.tokens[0]) == 80
