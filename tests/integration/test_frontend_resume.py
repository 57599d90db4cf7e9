"""Streams through the frontend survive a scheduler crash: kill -9 mid-stream, restart, and
every client sees one uninterrupted stream equal to an undisturbed run's."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from scheduler_svc.local.redis_server import RedisServer
from tests.support.frontend import Frontend
from tests.support.stack import make_stack

NUM_STREAMS = 20
MAX_TOKENS = 48


@pytest.fixture
def stack_and_frontend(tmp_path):
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    (tmp_path / "w").mkdir()
    stack = make_stack(tmp_path / "w", redis)
    fe = Frontend.start(tmp_path / "fe", stack.address, "--resume-timeout", "120")
    try:
        fe.wait_healthy()
        yield stack, fe
    finally:
        fe.stop()
        stack.stop()
        redis.close()


def _args(i: int, model: str) -> dict:
    args = dict(
        model=model,
        messages=[{"role": "user", "content": f"Story number {i}:"}],
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )
    # Half greedy, half sampled with a seed: both must come out the same after the crash.
    args.update(temperature=0.0) if i % 2 == 0 else args.update(temperature=0.9, seed=100 + i)
    return args


def test_streams_survive_scheduler_kill(stack_and_frontend):
    stack, fe = stack_and_frontend
    oai = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="unused", max_retries=0, timeout=180)
    model = oai.models.list().data[0].id
    want = [
        oai.chat.completions.create(**_args(i, model)).choices[0].message.content
        for i in range(NUM_STREAMS)
    ]
    got: list[str | None] = [None] * NUM_STREAMS
    finishes: list[str | None] = [None] * NUM_STREAMS
    errors: list[BaseException] = []
    progress = [0] * NUM_STREAMS

    def run(i: int) -> None:
        try:
            text = []
            for chunk in oai.chat.completions.create(**_args(i, model), stream=True):
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    progress[i] += 1
                    finishes[i] = choice.finish_reason or finishes[i]
            got[i] = "".join(text)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(progress) < 4:  # every stream is under way
        assert time.monotonic() < deadline, progress
        time.sleep(0.01)
    stack.kill_scheduler()
    killed_at = list(progress)
    time.sleep(0.5)
    stack.start_scheduler()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert min(killed_at) < MAX_TOKENS, "the kill came after the streams had finished"
    assert got == want
    assert finishes == ["length"] * NUM_STREAMS
    log = fe.log()
    assert "frontend.stream_interrupted" in log  # they were cut, and resumed
    assert "Traceback" not in log, log


def test_full_queue_is_429(tmp_path):
    """RESOURCE_EXHAUSTED from the scheduler (its waiting queue is full) is HTTP 429."""
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    (tmp_path / "w").mkdir()
    stack = make_stack(
        tmp_path / "w", redis, scheduler_args=["--max-num-seqs", "1", "--max-waiting", "1"]
    )
    fe = Frontend.start(tmp_path / "fe", stack.address)
    try:
        fe.wait_healthy()
        # Long enough (the tiny model's context is 512) that the first is still running when
        # the others arrive: one runs, one waits, the rest find the queue full.
        body = {"prompt": "x", "max_tokens": 480, "ignore_eos": True}
        results: list[tuple[int, object]] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(fe.request("POST", "/v1/completions", body))
            )
            for _ in range(4)
        ]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=120)
        statuses = sorted(status for status, _ in results)
        assert 200 in statuses and 429 in statuses, results
        err = next(e for s, e in results if s == 429)
        assert err["error"]["type"] == "rate_limit_error" and "queue" in err["error"]["message"]
    finally:
        fe.stop()
        stack.stop()
        redis.close()
