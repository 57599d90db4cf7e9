"""Async scheduling end to end: decode steps planned ahead change nothing a client sees.

Two stacks on the same demo model, one with async scheduling (the default) and one with
`--no-async-scheduling`, run the same requests: sequences that end by length at different steps,
by a stop token and by a stop string in the middle of a run of planned-ahead steps (their extra
token must never show), with logprobs (sent as differences, not in the decode lane) and n > 1
(never planned ahead). Outputs must be identical, and the async stack must really have planned
steps ahead (its Prometheus counter says how many).

The async stack's executor also overlaps its steps (``LLMSERVE_OVERLAP_STEPS=1``, the CUDA
default): a step planned ahead is launched before the host has the draws of the one before,
whose tokens it takes on the device (api/step.py ``Flight``).
"""

from __future__ import annotations

import os
import time
from unittest import mock

import pytest

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import (
    Collected,
    collect,
    gen_request,
    run_in_threads,
    stub_for,
    wait_until_idle,
)
from tests.support.prom import free_port, scrape, total
from tests.support.stack import make_stack

PROMPTS = [[5 + 7 * i + j for j in range(3 + 5 * i)] for i in range(6)]


def _planned_ahead(port: int) -> float:
    return total(scrape(port), "llmserve:executor_steps_planned_ahead_total")


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """{"async": (stub, metrics port), "sync": (stub, metrics port)}."""
    out, cleanup = {}, []
    try:
        for name, extra in (("async", []), ("sync", ["--no-async-scheduling"])):
            tmp = tmp_path_factory.mktemp(name)
            redis = RedisServer(data_dir=tmp / "redis")
            redis.start()
            cleanup.append(redis.close)
            port = free_port()
            overlap = {"LLMSERVE_OVERLAP_STEPS": "1" if name == "async" else "0"}
            with mock.patch.dict(os.environ, overlap):
                stack = make_stack(tmp, redis, scheduler_args=["--metrics-port", str(port), *extra])
            cleanup.append(stack.stop)
            channel, stub = stub_for(stack.address)
            cleanup.append(channel.close)
            out[name] = (stub, port)
        yield out
    finally:
        for fn in reversed(cleanup):
            fn()


def _run(stub, requests: list[dict]) -> list[Collected]:
    """All requests at once (so they decode together), each in its own thread."""
    return run_in_threads(
        [
            lambda r=r: collect(stub.Generate(gen_request(r["prompt"], **r["params"]), timeout=120))
            for r in requests
        ]
    )


def test_outputs_are_identical_with_and_without_planning_ahead(stacks):
    sync_stub, sync_port = stacks["sync"]
    async_stub, async_port = stacks["async"]
    # Greedy references first: stop tokens and strings are taken from the middle of them.
    plain = [
        {"prompt": p, "params": {"max_tokens": 12 + 3 * i, "temperature": 0.0, "ignore_eos": True}}
        for i, p in enumerate(PROMPTS)
    ]
    ref = _run(sync_stub, plain)
    requests = list(plain)
    stop_token = ref[0].tokens[0][6]
    requests.append(
        {
            "prompt": PROMPTS[0],
            "params": {"max_tokens": 30, "temperature": 0.0, "stop_token_ids": [stop_token]},
        }
    )
    stop_text = ref[1].text[0][len(ref[1].text[0]) // 2 :][:3]
    if stop_text.strip():
        requests.append(
            {
                "prompt": PROMPTS[1],
                "params": {"max_tokens": 30, "temperature": 0.0, "stop": [stop_text]},
            }
        )
    requests.append(
        {"prompt": PROMPTS[2], "params": {"max_tokens": 9, "temperature": 0.0, "logprobs": 2}}
    )
    requests.append(
        {
            "prompt": PROMPTS[3],
            "params": {"max_tokens": 8, "temperature": 0.8, "seed": 3, "n": 2},
        }
    )
    requests.append(
        {"prompt": PROMPTS[4], "params": {"max_tokens": 14, "temperature": 0.7, "seed": 11}}
    )
    # Every request reports its tokens' logprobs: equal floats with and without steps planned
    # ahead mean equal logits (step invariance, issue 24), not just equal argmaxes.
    for r in requests:
        r["params"].setdefault("logprobs", 0)
    ahead_before = _planned_ahead(async_port)
    expected = _run(sync_stub, requests)
    got = _run(async_stub, requests)
    for req, e, g in zip(requests, expected, got, strict=True):
        assert e.error is None and g.error is None, (e.error, g.error)
        assert g.offsets_ok
        assert g.tokens == e.tokens, req
        assert g.text == e.text, req
        assert g.finish == e.finish, req
        assert g.logprobs == e.logprobs and g.logprobs, req
    assert got[len(plain)].finish[0] == pb.FINISH_REASON_STOP
    assert got[len(plain)].tokens[0] == ref[0].tokens[0][: ref[0].tokens[0].index(stop_token) + 1]
    assert _planned_ahead(async_port) > ahead_before + 5
    assert _planned_ahead(sync_port) == 0


def test_an_abort_gets_in_between_planned_ahead_steps(stacks):
    """A request decoding alone keeps its steps planned ahead; an abort from another client
    still ends it at once (the loop stops planning ahead while the abort waits)."""
    stub, port = stacks["async"]
    stream = stub.Generate(
        gen_request([9, 8, 7], request_id="long", max_tokens=480, ignore_eos=True), timeout=120
    )
    got = Collected()
    for msg in stream:
        got.add(msg)
        if len(got.tokens.get(0, [])) >= 40:
            break
    assert _planned_ahead(port) > 20
    t0 = time.monotonic()
    assert stub.Abort(pb.AbortRequest(request_id="long")).aborted
    collect(stream, got)
    assert time.monotonic() - t0 < 5.0
    assert got.finish[0] == pb.FINISH_REASON_ABORT
    assert len(got.tokens[0]) < 480
    info = wait_until_idle(stub)
    assert info.kv_cache_usage == 0.0 and info.num_running == 0
