"""The Redis store against a real Redis server: layout, idempotent appends, TTL, outages."""

import asyncio
import json

import pytest
import redis
import redis.asyncio

from scheduler_svc.state.store import (
    FORMAT_VERSION,
    Created,
    FinishRecord,
    RequestStore,
    StoredRequest,
    StoreFenced,
    StoreFormatError,
    StoreGapError,
    StoreUnavailable,
    TokenAppend,
)


def make_record(req_id: str = "r1", n: int = 1, arrival: float = 1.0) -> StoredRequest:
    return StoredRequest(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        params={"max_tokens": 8, "seed": 7, "temperature": 0.8, "n": n},
        priority=2,
        arrival_time=arrival,
        n=n,
    )


def run(coro):
    return asyncio.run(coro)


def test_create_get_and_duplicate_id(redis_url):
    async def go():
        store = RequestStore(redis_url)
        assert await store.create(make_record())
        assert not await store.create(make_record())  # same id never stored twice
        rec = await store.get("r1")
        await store.close()
        return rec

    rec = run(go())
    assert rec.prompt_token_ids == [1, 2, 3]
    assert rec.params["seed"] == 7
    assert rec.priority == 2 and rec.n == 1 and not rec.finished
    assert rec.outputs == [[]]
    raw = redis.Redis.from_url(redis_url)
    assert raw.hget("llmserve:request:r1", "v") == str(FORMAT_VERSION).encode()
    assert raw.smembers("llmserve:index:unfinished") == {b"r1"}


def test_an_abort_ahead_of_its_request_is_met_by_the_claim(redis_url):
    """The tombstone and the claim are ordered by Redis: whichever runs second sees the other."""

    async def go():
        store = RequestStore(redis_url, finished_ttl_s=100)
        assert await store.abort_ahead("early", ttl_s=60) is None  # unknown: tombstoned
        assert await store.create(make_record("early", n=2)) is Created.ABORTED
        aborted = await store.get("early")
        assert await store.create(make_record("early", n=2)) is Created.EXISTS
        assert await store.abort_ahead("early", ttl_s=60) == "finished"
        assert await store.create(make_record("late")) is Created.NEW
        assert await store.abort_ahead("late", ttl_s=60) == "active"  # no tombstone then
        await store.abort_ahead("kept", ttl_s=60)
        # Recovery's rewrite of a running request ignores a tombstone (and leaves it).
        assert await store.create(make_record("kept"), honour_abort=False) is Created.NEW
        await store.abort_ahead("brief", ttl_s=0.2)
        await asyncio.sleep(0.4)
        assert await store.create(make_record("brief")) is Created.NEW  # it expired
        await store.close()
        return aborted

    aborted = run(go())
    assert aborted.finished and aborted.finish_reasons == ["abort", "abort"]
    assert aborted.outputs == [[], []]
    raw = redis.Redis.from_url(redis_url)
    assert raw.smembers("llmserve:index:unfinished") == {b"late", b"kept", b"brief"}
    assert not raw.exists("llmserve:abort:early")  # consumed by the claim
    assert raw.exists("llmserve:abort:kept")
    assert 0 < raw.pttl("llmserve:request:early") <= 100_000  # expires like any finished one
    assert 0 < raw.pttl("llmserve:abort:kept") <= 60_000


def test_abort_ahead_and_its_claim_are_fenced_by_the_leader_epoch(redis_url):
    async def go():
        raw = redis.asyncio.Redis.from_url(redis_url)
        await raw.set("llmserve:leader:epoch", 2)
        store = RequestStore(redis_url)
        store.epoch = 2
        assert await store.abort_ahead("e", ttl_s=60) is None
        assert await store.create(make_record("e")) is Created.ABORTED
        store.epoch = 1  # deposed: another scheduler leads now
        with pytest.raises(StoreFenced):
            await store.abort_ahead("f", ttl_s=60)
        assert not await raw.exists("llmserve:abort:f")
        await store.close()
        await raw.aclose()

    run(go())


def test_append_is_idempotent_and_detects_gaps(redis_url):
    async def go():
        store = RequestStore(redis_url)
        await store.create(make_record(n=2))
        await store.write_step([TokenAppend("r1", 0, 0, [5, 6]), TokenAppend("r1", 1, 0, [9])], [])
        # A retried write (reply lost) and an overlapping one add only what is missing.
        await store.write_step([TokenAppend("r1", 0, 0, [5, 6])], [])
        await store.write_step([TokenAppend("r1", 0, 1, [6, 7])], [])
        with pytest.raises(StoreGapError):
            await store.write_step([TokenAppend("r1", 1, 5, [1])], [])
        rec = await store.get("r1")
        tail = await store.get("r1", from_index=2)
        await store.close()
        return rec, tail

    rec, tail = run(go())
    assert rec.outputs == [[5, 6, 7], [9]]
    assert tail.outputs == [[7], []]


def test_gap_writes_nothing_and_retried_logprobs_are_not_duplicated(redis_url):
    lp = [{"logprob": -0.5, "top": []}, {"logprob": -1.0, "top": []}, {"logprob": -2.0, "top": []}]

    async def go():
        store = RequestStore(redis_url)
        await store.create(make_record(n=2))
        with pytest.raises(StoreGapError):  # nothing stored yet, append at offset 3
            await store.write_step([TokenAppend("r1", 1, 3, [4])], [])
        await store.write_step([TokenAppend("r1", 0, 0, [5, 6], lp[:2])], [])
        await store.write_step([TokenAppend("r1", 0, 1, [6, 7], lp[1:])], [])  # overlap
        # A restarted Redis (or SCRIPT FLUSH) forgets the script: it is loaded again.
        await store._redis.script_flush()
        await store.write_step([TokenAppend("r1", 0, 3, [8], [lp[0]])], [])
        rec = await store.get("r1")
        await store.close()
        return rec

    rec = run(go())
    raw = redis.Redis.from_url(redis_url)
    assert not raw.exists("llmserve:tokens:r1:1")
    assert rec.outputs == [[5, 6, 7, 8], []]
    assert [e["logprob"] for e in rec.logprobs[0]] == [-0.5, -1.0, -2.0, -0.5]


def test_logprobs_stored_alongside_tokens(redis_url):
    async def go():
        store = RequestStore(redis_url)
        await store.create(make_record())
        lp = [{"logprob": -0.5, "top": [[5, -0.5]]}, {"logprob": -1.0, "top": [[6, -1.0]]}]
        await store.write_step([TokenAppend("r1", 0, 0, [5, 6], lp)], [])
        rec = await store.get("r1")
        await store.close()
        return rec

    rec = run(go())
    assert rec.logprobs[0][1] == {"logprob": -1.0, "top": [[6, -1.0]]}


def test_finish_sets_ttl_and_leaves_unfinished_index(redis_url):
    async def go():
        store = RequestStore(redis_url, finished_ttl_s=0.4)
        await store.create(make_record("a", arrival=2.0))
        await store.create(make_record("b", arrival=1.0))
        await store.write_step(
            [TokenAppend("a", 0, 0, [4])], [FinishRecord("a", 1, ["stop"], ["4"])]
        )
        finished = await store.get("a")
        unfinished = [r.req_id for r in await store.list_unfinished()]
        await asyncio.sleep(0.8)
        expired = await store.get("a")
        still = await store.get("b")
        await store.close()
        return finished, unfinished, expired, still

    finished, unfinished, expired, still = run(go())
    assert finished.finished and finished.finish_reasons == ["stop"]
    assert finished.stop_reasons == ["4"] and finished.outputs == [[4]]
    assert unfinished == ["b"]
    assert expired is None  # TTL expiry of finished requests
    assert still is not None and not still.finished  # unfinished ones never expire


def test_newer_format_is_refused_clearly(redis_url):
    raw = redis.Redis.from_url(redis_url)
    raw.hset(
        "llmserve:request:x",
        mapping={"v": FORMAT_VERSION + 1, "prompt": "[1]", "params": json.dumps({}), "n": 1},
    )

    async def go():
        store = RequestStore(redis_url)
        try:
            with pytest.raises(StoreFormatError, match="upgrade llmserve"):
                await store.get("x")
        finally:
            await store.close()

    run(go())


def test_unavailable_while_redis_down_and_data_survives_restart(redis_server, redis_url):
    async def write():
        store = RequestStore(redis_url)
        await store.create(make_record())
        await store.write_step([TokenAppend("r1", 0, 0, [1, 2, 3])], [])
        await store.close()

    run(write())
    redis_server.stop(kill=True)  # kill -9: append-only with fsync always keeps acked writes

    async def down():
        store = RequestStore(redis_url, timeout_s=0.5)
        try:
            assert not await store.ping()
            with pytest.raises(StoreUnavailable):
                await store.create(make_record("r2"))
            with pytest.raises(StoreUnavailable):
                await store.write_step([TokenAppend("r1", 0, 3, [4])], [])
        finally:
            await store.close()

    run(down())
    redis_server.start()

    async def back():
        store = RequestStore(redis_url)
        rec = await store.get("r1")
        await store.close()
        return rec

    assert run(back()).outputs == [[1, 2, 3]]


def test_persister_writes_in_order_publishes_after_ack_and_waits_for_kick(redis_url):
    """Steps go to Redis in order; a step queued without waking waits for kick()."""
    from scheduler_svc.state.persister import Persister, StepRecord

    raw = redis.Redis.from_url(redis_url)
    published: list[tuple[int, list[int]]] = []

    def on_ack(i: int):
        # What Redis holds at the moment step i is published (a blocking read, fine here).
        return lambda: published.append(
            (i, [int(t) for t in raw.lrange("llmserve:tokens:r1:0", 0, -1)])
        )

    async def go():
        store = RequestStore(redis_url)
        await store.create(make_record())
        persister = Persister(store)
        persister.start()
        persister.submit(StepRecord([TokenAppend("r1", 0, 0, [5])], [], on_ack(0)))
        await persister.wait_drained()
        persister.submit(StepRecord([TokenAppend("r1", 0, 1, [6])], [], on_ack(1)), wake=False)
        persister.submit(StepRecord([TokenAppend("r1", 0, 2, [7])], [], on_ack(2)), wake=False)
        await asyncio.sleep(0.2)
        held = list(published)
        persister.kick()
        await persister.wait_drained()
        await persister.stop()
        await store.close()
        return held

    held = run(go())
    assert held == [(0, [5])]  # nothing of steps 1 and 2 written or published before the kick
    # Written together after the kick, published in order, each only once Redis held it.
    assert published == [(0, [5]), (1, [5, 6, 7]), (2, [5, 6, 7])]
