"""The Batch API's Redis store on a real Redis: a line's result recorded and counted once, a
lease held by one runner at a time and taken over once it lapses, statuses that only move
forward."""

from __future__ import annotations

import asyncio
import json

import pytest

from frontend_svc.batch.redis_conn import connect
from frontend_svc.batch.store import ACTIVE, BatchStore
from scheduler_svc.local.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.close()


def _run(redis_url, body):
    async def main():
        store = BatchStore(connect(redis_url))
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def test_a_result_is_recorded_and_counted_once(redis_url):
    async def body(store: BatchStore):
        await store.create_batch({"id": "batch_r"}, "owner", "owner")
        first = await store.record("batch_r", 4, '{"n": 1}', True)
        again = await store.record("batch_r", 4, '{"n": 2}', False)
        other = await store.record("batch_r", 5, '{"n": 3}', False)
        return first, again, other, await store.results("batch_r"), await store.batch("batch_r")

    first, again, other, results, b = _run(redis_url, body)
    assert (first, again, other) == (True, False, True)
    assert results == {4: '{"n": 1}', 5: '{"n": 3}'}
    assert (b["completed"], b["failed"]) == ("1", "1")


def test_one_lease_holder_and_takeover_after_it_lapses(redis_url):
    async def body(store: BatchStore):
        got = [await store.claim("batch_l", "a", 300), await store.claim("batch_l", "b", 300)]
        got.append(await store.renew("batch_l", "b", 300))  # not b's to renew
        got.append(await store.renew("batch_l", "a", 300))
        await asyncio.sleep(0.5)  # a stopped renewing (killed)
        got.append(await store.claim("batch_l", "b", 300))
        await store.release("batch_l", "a")  # a late release of a lost lease changes nothing
        got.append(await store.claim("batch_l", "c", 300))
        return got

    assert _run(redis_url, body) == [True, False, False, True, True, False]


def test_statuses_move_only_forward(redis_url):
    async def body(store: BatchStore):
        await store.create_batch({"id": "batch_s"}, "o", "o")
        moves = [
            await store.move("batch_s", "in_progress", ("validating",), total=3),
            await store.move("batch_s", "cancelling", ("validating", "in_progress")),
            await store.move("batch_s", "cancelled", ("cancelling",)),
            await store.move("batch_s", "cancelling", ("validating", "in_progress")),
        ]
        active = [x.decode() for x in await store.redis.smembers(ACTIVE)]
        return moves, await store.batch("batch_s"), active

    moves, b, active = _run(redis_url, body)
    assert moves == [True, True, True, False]
    assert b["status"] == "cancelled" and b["total"] == "3"
    assert int(b["cancelled_at"]) >= int(b["in_progress_at"]) and "batch_s" not in active
    assert json.loads(b["obj"]) == {"id": "batch_s"}
