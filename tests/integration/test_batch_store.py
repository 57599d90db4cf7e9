"""The Batch API's Redis store on a real Redis: a line's result recorded and counted once, a
lease held by one runner at a time and taken over once it lapses, statuses that only move
forward."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis as redis_lib

from frontend_svc.batch.redis_conn import connect
from frontend_svc.batch.store import ACTIVE, BatchStore, NotReplicated
from scheduler_svc.local.redis_server import RedisServer
from tests.support.redis_ha import MASTER, RedisHA


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.close()


def _run(redis_url, body):
    return asyncio.run(_with_store(connect(redis_url), body))


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


def test_the_store_follows_sentinel_to_a_new_primary(tmp_path):
    """--redis-sentinel: after kill -9 of the primary, the store's writes go to the node Sentinel
    promotes, and what a replica had acknowledged is there."""
    ha = RedisHA(tmp_path / "ha").start()

    async def go(store: BatchStore) -> tuple[float, dict[int, str]]:
        await store.create_batch({"id": "batch_ha"}, "o", "o")  # WAITs for a replica
        assert await store.record("batch_ha", 0, "zero", True)
        await store.replicated()
        old = ha.kill_primary()
        t0 = time.monotonic()
        while True:  # as the runner does: a failed write is tried again
            try:
                assert await store.record("batch_ha", 1, "one", True)
                break
            except redis_lib.RedisError:
                assert time.monotonic() - t0 < 30, "no new primary took the write"
                await asyncio.sleep(0.1)
        assert ha.wait_failover(old) is not old
        return time.monotonic() - t0, await store.results("batch_ha")

    try:
        outage, results = asyncio.run(
            _with_store(connect("redis://", ha.sentinel_addresses, MASTER), go, min_replicas=1)
        )
    finally:
        ha.close()
    assert results == {0: "zero", 1: "one"} and outage < 15


async def _with_store(client, body, **store_args):
    store = BatchStore(client, **store_args)
    try:
        return await body(store)
    finally:
        await store.close()


def test_a_write_too_few_replicas_hold_is_not_reported_stored(redis_url):
    """--redis-min-replicas 1 on a Redis without replicas: the upload is refused (the route
    answers 503), not acknowledged as durable."""

    async def body(store: BatchStore):
        with pytest.raises(NotReplicated, match="0 of 1"):
            await store.put_file({"id": "file-x"}, "o", b"{}")

    asyncio.run(_with_store(connect(redis_url), body, min_replicas=1, replica_timeout_ms=50))
