"""API keys: the scheduler's gRPC API and the frontend's HTTP API refuse calls without a valid
key (UNAUTHENTICATED / 401 in the OpenAI shape) and serve them with one; health and metrics
stay open. Real processes, the official openai client, grpc's own health client."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import AbortOutcome, LLMClient, LLMServeError, SamplingParams
from scheduler_svc.local.redis_server import RedisServer
from tests.support.frontend import Frontend
from tests.support.stack import make_stack

KEY, OTHER_KEY = "sk-test-7f3a", "sk-test-second"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    keys = tmp / "keys.txt"
    keys.write_text(f"# two tenants\n{KEY} alice\n{OTHER_KEY} bob\n")
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    stack = make_stack(tmp, redis, scheduler_args=["--api-key-file", str(keys)])
    fe = Frontend.start(tmp / "fe", stack.address, "--api-key-file", str(keys))
    try:
        fe.wait_healthy()
        yield stack, fe
    finally:
        fe.stop()
        stack.stop()
        redis.close()


@pytest.mark.parametrize(("key", "needle"), [(None, "missing"), ("sk-wrong", "invalid")])
def test_grpc_without_a_valid_key_is_unauthenticated(secured, key, needle, monkeypatch):
    stack, _ = secured
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    with LLMClient(stack.address, timeout=10, api_key=key) as client:
        for call in (
            client.server_info,
            lambda: client.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False),
            lambda: client.get_request("some-id"),
        ):
            with pytest.raises(LLMServeError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert needle in e.value.message


def test_grpc_with_a_key_works_and_health_stays_open(secured, monkeypatch):
    stack, _ = secured
    for key in (KEY, OTHER_KEY):
        with LLMClient(stack.address, timeout=30, api_key=key) as client:
            (out,) = client.generate([1, 2, 3], SamplingParams(max_tokens=3), use_tqdm=False)
            assert len(out.outputs[0].token_ids) >= 1
    # The client reads $LLMSERVE_API_KEY when given no key.
    monkeypatch.setenv("LLMSERVE_API_KEY", OTHER_KEY)
    with LLMClient(stack.address, timeout=30) as client:
        assert client.server_info().model
    with grpc.insecure_channel(stack.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_http_without_a_valid_key_is_401_in_the_openai_shape(secured):
    _, fe = secured
    for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": KEY}):
        status, body = fe.request(
            "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=headers
        )
        assert status == 401, body
        assert body["error"]["type"] == "authentication_error"
    status, _ = fe.request("GET", "/v1/models")
    assert status == 401
    assert fe.request("GET", "/health")[0] == 200
    assert fe.request("GET", "/metrics")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{fe.port}/v1", api_key="sk-wrong").models.list()


def test_http_with_a_key_works_through_the_official_client(secured):
    _, fe = secured
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{fe.port}/v1", api_key=OTHER_KEY)
    model = oai.models.list().data[0].id
    got = oai.completions.create(model=model, prompt="Hello", max_tokens=3)
    assert got.usage.completion_tokens >= 1


def test_through_the_frontend_requests_belong_to_the_callers_key(secured):
    stack, fe = secured
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    status, mine = fe.request(
        "POST",
        "/v1/completions",
        body,
        headers={"authorization": f"Bearer {KEY}", "x-request-id": "fe-shared"},
    )
    assert status == 200, mine
    # Bob retries "the same" id with his own prompt: his own request, not an attach to alice's.
    status, theirs = fe.request(
        "POST",
        "/v1/completions",
        {**body, "prompt": [9, 10, 11, 12]},
        headers={"authorization": f"Bearer {OTHER_KEY}", "x-request-id": "fe-shared"},
    )
    assert status == 200, theirs
    assert theirs["usage"]["prompt_tokens"] == 4 and mine["usage"]["prompt_tokens"] == 3
    with (
        LLMClient(stack.address, timeout=30, api_key=KEY) as alice,
        LLMClient(stack.address, timeout=30, api_key=OTHER_KEY) as bob,
    ):
        assert alice.get_request("fe-shared").prompt_token_ids == [5, 6, 7]
        assert bob.get_request("fe-shared").prompt_token_ids == [9, 10, 11, 12]


def _code(call) -> grpc.StatusCode | None:
    try:
        call()
    except LLMServeError as e:
        return e.code
    return None


def test_an_abort_by_another_key_never_ends_the_request(secured):
    """Bob aborting alice's running id names his own (unknown) request: alice's runs on, and
    the abort waits for bob's own request with that id (which it then ends)."""
    stack, _ = secured
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    with (
        LLMClient(stack.address, timeout=30, api_key=KEY) as alice,
        LLMClient(stack.address, timeout=30, api_key=OTHER_KEY) as bob,
    ):
        stream = alice.stream([5, 6, 7], long, request_id="contested")
        first = next(stream)
        assert bob.abort("contested") is AbortOutcome.PENDING  # nothing of bob's exists
        rest = list(stream)
        tokens = list(first.token_ids) + [t for d in rest for t in d.token_ids]
        assert len(tokens) == 300 and rest[-1].finish_reason == "length"
        assert alice.get_request("contested").outputs[0].finish_reason == "length"
        # Bob's own request with that id is the one his abort was kept for.
        mine = list(bob.stream([9, 10], long, request_id="contested"))
        assert [d.finish_reason for d in mine][-1] == "abort"
        assert sum(len(d.token_ids) for d in mine) == 0


def test_requests_belong_to_the_key_that_created_them(secured):
    stack, _ = secured
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with (
        LLMClient(stack.address, timeout=30, api_key=KEY) as alice,
        LLMClient(stack.address, timeout=30, api_key=OTHER_KEY) as bob,
    ):
        mine = list(alice.stream([5, 6, 7], params, request_id="shared-id"))
        assert {d.request_id for d in mine} == {"shared-id"}  # ids come back as chosen
        assert alice.get_request("shared-id").prompt_token_ids == [5, 6, 7]
        # Another key cannot see or resume it: to bob it does not exist.
        assert _code(lambda: bob.get_request("shared-id")) == grpc.StatusCode.NOT_FOUND
        assert _code(lambda: list(bob.resume("shared-id"))) == grpc.StatusCode.NOT_FOUND
        # The same id under bob's key is bob's own request, not an attach to alice's.
        theirs = list(bob.stream([9, 10, 11, 12], params, request_id="shared-id"))
        assert sum(len(d.token_ids) for d in theirs) == 4
        assert bob.get_request("shared-id").prompt_token_ids == [9, 10, 11, 12]
        assert alice.get_request("shared-id").prompt_token_ids == [5, 6, 7]
    # Ownership is part of what Redis holds: it survives a scheduler restart.
    stack.kill_scheduler()
    stack.start_scheduler()
    with (
        LLMClient(stack.address, timeout=30, api_key=KEY) as alice,
        LLMClient(stack.address, timeout=30, api_key=OTHER_KEY) as bob,
    ):
        alice.wait_ready(60)
        assert alice.get_request("shared-id").prompt_token_ids == [5, 6, 7]
        assert bob.get_request("shared-id").prompt_token_ids == [9, 10, 11, 12]
        resumed = list(alice.resume("shared-id"))
        assert [t for d in resumed for t in d.token_ids] == [t for d in mine for t in d.token_ids]


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY} alice\n{OTHER_KEY} bob\n")
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    stack = make_stack(
        tmp,
        redis,
        scheduler_args=["--api-key-file", str(keys), "--max-requests-per-key", "1",
                        "--max-queued-tokens-per-key", "8", "--no-reflection"],
    )  # fmt: skip
    try:
        yield stack
    finally:
        stack.stop()
        redis.close()


def test_per_key_limits_are_resource_exhausted_for_that_key_only(limited):
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with (
        LLMClient(limited.address, timeout=30, api_key=KEY) as alice,
        LLMClient(limited.address, timeout=30, api_key=OTHER_KEY) as bob,
    ):
        # A prompt over the key's queued-token limit is refused outright.
        with pytest.raises(LLMServeError) as e:
            alice.generate(list(range(5, 15)), SamplingParams(max_tokens=1), use_tqdm=False)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "prompt tokens" in e.value.message
        # One unfinished request per key: alice's second waits for her first, bob is not held up.
        stream = alice.stream([5, 6, 7], long, request_id="alice-long")
        first = next(stream)  # running now
        assert first.token_ids
        with pytest.raises(LLMServeError) as e:
            alice.generate([8, 9], SamplingParams(max_tokens=1), use_tqdm=False)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "unfinished requests" in e.value.message
        (theirs,) = bob.generate([8, 9], SamplingParams(max_tokens=2), use_tqdm=False)
        assert theirs.outputs[0].token_ids
        assert alice.abort("alice-long") is AbortOutcome.ABORTED
        for _ in stream:
            pass
        (again,) = alice.generate([8, 9], SamplingParams(max_tokens=2), use_tqdm=False)
        assert again.outputs[0].token_ids


def _grpcurl_list(address: str) -> subprocess.CompletedProcess:
    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    return subprocess.run(
        [grpcurl, "-plaintext", address, "list"], capture_output=True, text=True, timeout=60
    )


def test_reflection_stays_open_with_keys_and_can_be_turned_off(secured, limited):
    stack, _ = secured
    listed = _grpcurl_list(stack.address)
    assert listed.returncode == 0 and "llmserve.v1.Scheduler" in listed.stdout, listed.stderr
    refused = _grpcurl_list(limited.address)  # started with --no-reflection
    assert refused.returncode != 0 and "llmserve.v1.Scheduler" not in refused.stdout
