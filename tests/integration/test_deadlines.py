"""Per-request deadlines (issue 46): waiting past one ends the request without running it
(DEADLINE_EXCEEDED / HTTP 408), running past one finishes it with the tokens so far (reason
"deadline" on the gRPC API, "length" on OpenAI's), and a scheduler kill -9 never restarts it.

Real Redis, executor, scheduler and frontend processes, one sequence slot (--max-num-seqs 1), so
that requests queued behind long ones wait. Timeouts for running requests are derived from a
measured undisturbed run, so that the tests hold on a fast machine and on a loaded one.
"""

from __future__ import annotations

import math
import time

import grpc
import pytest
import redis

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import collect, gen_request, stub_for
from tests.support.frontend import Frontend
from tests.support.prom import free_port, scrape, total
from tests.support.stack import make_stack

PROMPT = [5, 6, 7, 8, 9]
NUM_TOKENS = 400  # fits the tiny model's 512 positions
LONG = 100_000  # ignore_eos: only the model length or an abort ends it
NUM_AHEAD = 8  # long requests queued ahead of one that must still be waiting at its deadline


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deadlines")
    server = RedisServer(data_dir=tmp / "redis")
    server.start()
    port = free_port()
    s = make_stack(tmp, server, scheduler_args=["--max-num-seqs", "1", "--metrics-port", str(port)])
    s.metrics_port = port
    try:
        yield s
    finally:
        s.stop()
        server.close()


@pytest.fixture(scope="module")
def frontend(stack, tmp_path_factory):
    fe = Frontend.start(tmp_path_factory.mktemp("fe"), stack.address)
    try:
        fe.wait_healthy()
        yield fe
    finally:
        fe.stop()
        assert "Traceback" not in fe.log(), fe.log()


@pytest.fixture
def api(stack):
    channel, stub = stub_for(stack.address)
    yield stub
    channel.close()


def _long(rid: str, timeout_s: float | None = None, detached: bool = True) -> pb.GenerateRequest:
    req = gen_request(PROMPT, request_id=rid, detached=detached, max_tokens=LONG,
                      ignore_eos=True, temperature=0)  # fmt: skip
    if timeout_s is not None:
        req.timeout_s = timeout_s
    return req


def _submit(api, req: pb.GenerateRequest) -> None:
    """Start a detached request and return once the scheduler holds it (it may be waiting)."""
    call = api.Generate(req, timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            api.GetRequest(pb.GetRequestRequest(request_id=req.request_id))
            break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, e
            time.sleep(0.02)
    call.cancel()  # detached: it keeps running


def _queue_long(api, prefix: str) -> list[str]:
    """NUM_AHEAD long requests: one runs, the rest wait behind it (one sequence slot)."""
    ids = [f"{prefix}-{i}" for i in range(NUM_AHEAD)]
    for rid in ids:
        _submit(api, _long(rid))
    return ids


def _abort_all(api, ids: list[str]) -> None:
    for rid in ids:
        api.Abort(pb.AbortRequest(request_id=rid))


def _undisturbed(api) -> tuple[list[int], float]:
    """The greedy output of PROMPT and how long it took (the machine's speed now)."""
    start = time.monotonic()
    ref = collect(api.Generate(gen_request(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True,
                                           temperature=0), timeout=300))  # fmt: skip
    assert ref.error is None and len(ref.tokens[0]) == NUM_TOKENS
    return ref.tokens[0], time.monotonic() - start


def test_waiting_past_its_deadline_ends_without_running(api, stack, frontend):
    ahead = _queue_long(api, "ahead-w")
    try:
        start = time.monotonic()
        got = collect(api.Generate(_long("w-1", 0.5, detached=False), timeout=60))
        elapsed = time.monotonic() - start
        assert got.error is not None and got.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline" in got.error.details() and not got.tokens
        assert 0.5 <= elapsed < 10, elapsed
        state = api.GetRequest(pb.GetRequestRequest(request_id="w-1"))
        assert state.status == pb.REQUEST_STATUS_FINISHED
        assert [s.finish_reason for s in state.sequences] == [pb.FINISH_REASON_DEADLINE]
        assert list(state.sequences[0].token_ids) == []
        # The same over HTTP: the body's timeout, the header, each in the API's error shape.
        body = {"prompt": "Hi", "max_tokens": 5, "timeout": 0.5}
        status, err = frontend.request("POST", "/v1/completions", body)
        assert status == 408 and err["error"]["type"] == "timeout", err
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
        status, err = frontend.request("POST", "/v1/chat/completions", chat,
                                       {"X-Request-Timeout": "0.5"})  # fmt: skip
        assert status == 408 and err["error"]["type"] == "timeout", err
        messages = {"model": _model(frontend), "max_tokens": 5, "timeout": 0.5,
                    "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
        status, err = frontend.request("POST", "/v1/messages", messages)
        assert status == 408 and err["type"] == "error", err
        assert err["error"]["type"] == "timeout_error", err
    finally:
        _abort_all(api, ahead)
    samples = scrape(stack.metrics_port)
    assert total(samples, "llmserve:request_deadline_exceeded_total", phase="waiting") >= 4


def _model(frontend) -> str:
    return frontend.request("GET", "/v1/models")[1]["data"][0]["id"]


def test_running_past_its_deadline_finishes_with_the_tokens_so_far(api, stack, frontend):
    ref, took = _undisturbed(api)
    before = total(scrape(stack.metrics_port), "llmserve:request_deadline_exceeded_total",
                   phase="running")  # fmt: skip
    req = gen_request(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0)
    req.timeout_s = took / 2  # half way through, at this machine's speed
    got = collect(api.Generate(req, timeout=300))
    assert got.error is None, got.error
    assert got.finish == {0: pb.FINISH_REASON_DEADLINE}
    tokens = got.tokens[0]
    assert 0 < len(tokens) < NUM_TOKENS and got.offsets_ok
    assert tokens == ref[: len(tokens)]  # what it had: a prefix of the undisturbed output
    after = total(scrape(stack.metrics_port), "llmserve:request_deadline_exceeded_total",
                  phase="running")  # fmt: skip
    assert after == before + 1
    # Over HTTP it is a truncated output: "length", with fewer tokens than asked for.
    body = {"prompt": "Hi", "max_tokens": NUM_TOKENS, "ignore_eos": True, "temperature": 0}
    whole = frontend.request("POST", "/v1/completions", body)[1]
    status, cut = frontend.request("POST", "/v1/completions", {**body, "timeout": took / 2})
    assert status == 200, cut
    assert cut["choices"][0]["finish_reason"] == "length"
    assert 0 < cut["usage"]["completion_tokens"] < NUM_TOKENS
    assert whole["choices"][0]["text"].startswith(cut["choices"][0]["text"])


def test_a_scheduler_kill_9_does_not_restart_the_deadline(api, stack):
    ahead = _queue_long(api, "ahead-k")
    timeout_s = 4.0
    submitted = time.monotonic()
    _submit(api, _long("k-1", timeout_s))
    store = redis.Redis.from_url(stack.redis.url)
    key = "llmserve:request:k-1"
    stored = float(store.hget(key, "deadline"))
    assert stored == pytest.approx(time.time() + timeout_s, abs=1.0)
    time.sleep(0.3)
    stack.kill_scheduler()
    stack.start_scheduler()
    ready = time.monotonic()
    channel, fresh = stub_for(stack.address)
    try:
        assert float(store.hget(key, "deadline")) == stored  # the recovered one kept it
        got = collect(fresh.Resume(pb.ResumeRequest(request_id="k-1"), timeout=60))
        ended = time.monotonic()
        assert got.error is not None and got.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # At the original deadline (or at once, if the restart took longer): a fresh deadline
        # would have run from the recovery, `timeout_s` after `ready` at the earliest.
        assert ended - submitted >= timeout_s - 0.5, (ended - submitted, ready - submitted)
        assert ended < ready + timeout_s - 1.0, (ended - submitted, ready - submitted)
        state = fresh.GetRequest(pb.GetRequestRequest(request_id="k-1"))
        assert [s.finish_reason for s in state.sequences] == [pb.FINISH_REASON_DEADLINE]
    finally:
        _abort_all(fresh, ahead)
        channel.close()
        store.close()


@pytest.mark.parametrize("value", [-1.0, 0.0, math.nan, math.inf, 1e12])
def test_a_bad_timeout_is_invalid_argument(api, value):
    req = gen_request(PROMPT, max_tokens=2)
    req.timeout_s = value
    with pytest.raises(grpc.RpcError) as info:
        list(api.Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_s" in info.value.details()


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"timeout": -1}, {}, "timeout"),
        ({"timeout": 1e12}, {}, "timeout"),
        ('{"prompt": "Hi", "timeout": NaN}', {}, "timeout"),
        ({}, {"X-Request-Timeout": "soon"}, "X-Request-Timeout"),
        ({}, {"X-Request-Timeout": "0"}, "X-Request-Timeout"),
        ({}, {"X-Request-Timeout": "inf"}, "X-Request-Timeout"),
    ],
)
def test_a_bad_http_timeout_is_a_400_naming_it(frontend, body, headers, param):
    if isinstance(body, dict):
        body = {"prompt": "Hi", "max_tokens": 2, **body}
    status, err = frontend.request("POST", "/v1/completions", body, headers)
    assert status == 400, err
    assert err["error"]["param"] == param, err


def test_the_server_default_bounds_every_request(api, stack):
    """--request-timeout applies to a request that gives none, and a longer timeout of its own
    does not extend it. (Last in the module: it restarts the scheduler with the flag.)"""
    stack.scheduler_args += ["--request-timeout", "0.2"]
    stack.kill_scheduler()
    stack.start_scheduler()
    channel, fresh = stub_for(stack.address)
    try:
        for own in (None, 30.0):
            req = gen_request(PROMPT, max_tokens=LONG, ignore_eos=True, temperature=0)
            if own is not None:
                req.timeout_s = own
            got = collect(fresh.Generate(req, timeout=60))
            if got.error is not None:  # no token yet at 0.2 s (a loaded machine)
                assert got.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, got.error
            else:  # without the default it would run to the model's length, "length"
                assert got.finish == {0: pb.FINISH_REASON_DEADLINE}, (own, got.finish)
    finally:
        channel.close()
