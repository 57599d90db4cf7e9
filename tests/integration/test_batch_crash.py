"""The issue's "done when" for the Batch API: a 200-line batch (chat, completions and embeddings
lines, greedy and seeded) survives kill -9 of the frontend and of the leader scheduler mid-way.
Every output line equals the same batch's undisturbed run (as canonical JSON, less the fields
fresh by nature: tests/support/batches.FRESH_FIELDS), each custom_id appears exactly once, and
request_counts are right. Real processes: Redis, an executor, a leader and a standby scheduler,
and frontends that find the leader over both addresses."""

from __future__ import annotations

import io
import signal
import time

import openai
import pytest
import redis as redis_lib

from scheduler_svc.local.redis_server import RedisServer
from tests.support.batches import canonical, jsonl, read_lines, wait_batch
from tests.support.frontend import Frontend
from tests.support.standby import electing_schedulers

NUM_LINES = 200


@pytest.fixture
def deployment(tmp_path):
    with electing_schedulers(tmp_path) as (start, redis):
        leader = start("a")
        leader.wait_serving(60)
        frontends: list[Frontend] = []  # stopped before the schedulers
        try:
            yield tmp_path, redis, (leader, start("b")), frontends
        finally:
            for fe in frontends:
                fe.stop()


def _frontend(tmp_path, redis, schedulers) -> Frontend:
    fe = Frontend.start(
        tmp_path / "fe",
        ",".join(s.address for s in schedulers),
        "--redis-url", redis.url, "--batch-lease", "2", "--batch-max-concurrency", "8",
        "--resume-timeout", "120",
    )  # fmt: skip
    fe.wait_healthy()
    return fe


def _oai(fe: Frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="unused", max_retries=2)


def _wait_completed(oai: openai.OpenAI, bid: str, n: int) -> None:
    deadline = time.monotonic() + 120
    while oai.batches.retrieve(bid).request_counts.completed < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def recorded(redis: RedisServer, bid: str) -> int:
    """Results recorded so far, read from Redis directly (no frontend may be up)."""
    with redis_lib.Redis.from_url(redis.url) as r:
        return r.hlen(f"llmserve:batch:{bid}:results")


def test_batch_survives_frontend_and_leader_kill(deployment):
    tmp_path, redis, schedulers, frontends = deployment
    fe = _frontend(tmp_path, redis, schedulers)
    frontends.append(fe)
    oai = _oai(fe)
    model = oai.models.list().data[0].id
    f = oai.files.create(
        file=("in.jsonl", io.BytesIO(jsonl(model, NUM_LINES, 16))), purpose="batch"
    )

    def start():
        return oai.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id

    t0 = time.monotonic()
    calm = wait_batch(oai, start(), {"completed", "failed"}, timeout=180)
    calm_s = time.monotonic() - t0
    assert calm.status == "completed" and calm.request_counts.completed == NUM_LINES
    want = {x["custom_id"]: x for x in read_lines(oai, calm.output_file_id)}

    t0 = time.monotonic()
    bid = start()
    _wait_completed(oai, bid, NUM_LINES // 5)
    fe.proc.send_signal(signal.SIGKILL)  # kill -9 of the frontend running the batch
    fe.proc.wait()
    # Only a runner records results: this count is where the killed one stopped, mid-batch.
    assert recorded(redis, bid) < NUM_LINES
    fe = _frontend(tmp_path, redis, schedulers)
    frontends.append(fe)
    oai = _oai(fe)
    _wait_completed(oai, bid, NUM_LINES // 2)
    leader = schedulers[0]
    leader.proc.send_signal(signal.SIGKILL)  # kill -9 of the leader: the standby takes over
    leader.proc.wait()
    assert recorded(redis, bid) < NUM_LINES  # lines were still running at the kill
    got = wait_batch(oai, bid, {"completed", "failed"}, timeout=240)
    print(f"undisturbed {calm_s:.1f}s, with kills {time.monotonic() - t0:.1f}s")
    assert got.status == "completed", got
    counts = got.request_counts
    assert (counts.total, counts.completed, counts.failed) == (NUM_LINES, NUM_LINES, 0)
    assert got.error_file_id is None
    out = read_lines(oai, got.output_file_id)
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(NUM_LINES)]  # each once
    for row in out:
        before = want[row["custom_id"]]["response"]
        assert row["response"]["status_code"] == before["status_code"] == 200
        assert canonical(row["response"]["body"]) == canonical(before["body"]), row["custom_id"]
    assert schedulers[1].health() is not None
    # The leader's kill cut streams of lines in flight, which the frontend resumed.
    assert "frontend.stream_interrupted" in fe.log()
    assert "Traceback" not in fe.log(), fe.log()[-3000:]
