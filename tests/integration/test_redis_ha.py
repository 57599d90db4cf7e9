"""The state store on Redis with replicas and Sentinel (tests/support/redis_ha.py): every
component follows Sentinel to a new primary, acknowledged writes wait for replicas, and the
leader epoch fences across a failover. Real redis-server processes, no mocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from executor_svc.api.registry import EXECUTORS_KEY, ExecutorRegistration
from scheduler_svc.features.lora.durable import LORA_ADAPTERS_KEY, LoraAdapterStore
from scheduler_svc.state.connect import RedisTarget, parse_sentinels
from scheduler_svc.state.leader import EPOCH_KEY, LEADER_KEY, LeaderLease
from scheduler_svc.state.persister import Persister, StepRecord
from scheduler_svc.state.store import (
    Created,
    RequestStore,
    StoredRequest,
    StoreFenced,
    StoreUnavailable,
    TokenAppend,
)
from tests.support.redis_ha import MASTER, RedisHA

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def ha(tmp_path) -> Iterator[RedisHA]:
    topology = RedisHA(tmp_path / "redis-ha").start()
    try:
        yield topology
    finally:
        topology.close()


def target(ha: RedisHA) -> RedisTarget:
    return RedisTarget(url="redis://", sentinels=ha.sentinel_addresses, master=MASTER)


def record(req_id: str) -> StoredRequest:
    return StoredRequest(req_id, [1, 2, 3], {"max_tokens": 64}, 0, 1.0, 1)


async def write_until_ok(store: RequestStore, appends: list[TokenAppend], timeout: float) -> float:
    """Retry a step's write as the persister does; returns how long it took to succeed."""
    t0 = time.monotonic()
    while True:
        try:
            await store.write_step(appends, [])
            return time.monotonic() - t0
        except StoreUnavailable:
            assert time.monotonic() - t0 < timeout, "no new primary took the write"
            await asyncio.sleep(0.05)


def test_parse_sentinels_accepts_lists_and_names_a_bad_entry():
    assert parse_sentinels("a:1, b:26379,[::1]:5") == (("a", 1), ("b", 26379), ("::1", 5))
    with pytest.raises(ValueError, match="'b'"):
        parse_sentinels("a:1,b")


def test_store_and_registry_follow_the_primary_through_two_failovers(ha):
    """kill -9 of the primary, twice: the store's writes and the executor's heartbeat go to
    whichever node Sentinel promotes, and every token acknowledged by a replica is there."""
    reg = ExecutorRegistration(
        None, "ex-ha", "10.0.0.9:1", interval_s=0.1, sentinels=ha.sentinel_addresses
    )

    async def go() -> list[float]:
        store = RequestStore(target(ha), min_replicas=1, timeout_s=0.5)
        await store.create(record("r"))
        outages, offset = [], 0
        for kill in range(2):
            for _ in range(20):
                await store.write_step([TokenAppend("r", 0, offset, [offset])], [])
                assert await store.replicate() >= 1
                offset += 1
            old = ha.kill_primary()
            outages.append(await write_until_ok(store, [TokenAppend("r", 0, offset, [offset])], 30))
            offset += 1
            assert ha.wait_failover(old) is not old
            if kill == 0:  # room for the second failover: two nodes again
                ha.restart_as_replica(old)
                ha.wait_healthy()
        stored = await store.get("r")
        await store.close()
        assert stored is not None and stored.outputs == [list(range(offset))]
        return outages

    reg.start()
    try:
        outages = asyncio.run(go())
        deadline = time.monotonic() + 10
        while b"ex-ha" not in ha.primary_client().smembers(EXECUTORS_KEY):
            assert time.monotonic() < deadline, "the heartbeat never reached the new primary"
            time.sleep(0.1)
    finally:
        reg.stop()
    assert all(o < 15 for o in outages), outages


def test_a_step_is_held_until_enough_replicas_acknowledge_it(ha):
    """--redis-min-replicas 2 with one replica stalled: the step's tokens are not released,
    the persister says why (health reads it); once the replica catches up they are."""
    stalled = ha.replicas()[0]

    async def go() -> None:
        store = RequestStore(target(ha), min_replicas=2, replica_timeout_ms=200)
        persister = Persister(store, retry_interval_s=0.05)
        persister.start()
        await store.create(record("h"))
        released = asyncio.Event()
        ha.pause(stalled)
        try:
            persister.submit(StepRecord([TokenAppend("h", 0, 0, [7])], on_ack=released.set))
            await asyncio.sleep(1.5)
            assert not released.is_set()
            assert not persister.healthy
            assert persister.replication_shortfall == (
                "1 of 2 Redis replicas acknowledged the last write"
            )
            assert persister.stats.num_unreplicated >= 2  # retried, each time short
        finally:
            ha.resume(stalled)
        await asyncio.wait_for(released.wait(), 10)
        assert persister.healthy and persister.replication_shortfall is None
        await persister.stop()
        await store.close()

    asyncio.run(go())


def test_with_the_degrade_flag_an_unreplicated_step_is_released_and_counted(ha):
    stalled = ha.replicas()[0]

    async def go() -> None:
        store = RequestStore(target(ha), min_replicas=2, replica_timeout_ms=200)
        store.release_unreplicated = True
        persister = Persister(store, retry_interval_s=0.05)
        persister.start()
        await store.create(record("d"))
        released = asyncio.Event()
        ha.pause(stalled)
        try:
            persister.submit(StepRecord([TokenAppend("d", 0, 0, [7])], on_ack=released.set))
            await asyncio.wait_for(released.wait(), 5)
            assert persister.healthy and persister.stats.num_unreplicated == 1
            assert persister.replicas_acked == 1
        finally:
            ha.resume(stalled)
        await persister.stop()
        await store.close()

    asyncio.run(go())


def test_the_leader_epoch_fences_a_deposed_leader_across_a_failover(ha):
    """Leader A (epoch 1) is deposed by B (epoch 2, acknowledged by a replica before B serves);
    the primary dies; on the promoted replica A's writes are still refused, B's accepted."""

    async def go() -> None:
        a = LeaderLease(target(ha), min_replicas=1)
        b = LeaderLease(target(ha), min_replicas=1)
        store_a = RequestStore(target(ha), timeout_s=0.5)
        store_b = RequestStore(target(ha), timeout_s=0.5)
        store_a.epoch = await a.acquire()
        await store_a.create(record("x"))
        ha.primary_client().delete(LEADER_KEY)  # A's lease lapsed (A paused, say)
        store_b.epoch = await b.acquire()
        assert store_b.epoch == store_a.epoch + 1
        old = ha.kill_primary()
        ha.wait_failover(old)
        assert int(ha.primary_client().get(EPOCH_KEY)) == store_b.epoch
        await write_until_ok(store_b, [TokenAppend("x", 0, 0, [1])], 30)
        for _ in range(50):  # its first try may still meet the dead primary's connection
            try:
                await store_a.write_step([TokenAppend("x", 0, 1, [2])], [])
                pytest.fail("a deposed leader wrote to the promoted replica")
            except StoreUnavailable:
                await asyncio.sleep(0.1)
            except StoreFenced:
                break
        else:
            pytest.fail("the deposed leader never reached the new primary")
        assert (await store_b.get("x")).outputs == [[1]]
        for c in (a, b, store_a, store_b):
            await c.close()

    asyncio.run(go())


def test_a_new_request_an_abort_and_an_adapter_wait_for_the_replicas(ha):
    """With --redis-min-replicas 2 and one replica stalled, a new request, an abort of an
    unknown id and a live-loaded adapter's entry are each held (a WAIT on their own connection)
    and refused when the replica stays silent; once it answers they are accepted, and every
    replica holds them before the caller hears so."""
    stalled = ha.replicas()[0]

    async def go() -> None:
        store = RequestStore(target(ha), min_replicas=2, replica_timeout_ms=100)
        store.create_hold_s = 0.5
        adapters = LoraAdapterStore(store)
        ha.pause(stalled)
        try:
            with pytest.raises(StoreUnavailable, match="1 of 2 Redis replicas"):
                await store.create(record("held"))
            with pytest.raises(StoreUnavailable, match="1 of 2 Redis replicas"):
                await store.abort_ahead("unknown", ttl_s=60)
            with pytest.raises(StoreUnavailable, match="1 of 2 Redis replicas"):
                await adapters.save("sql", "/adapters/sql")
            store.create_hold_s = 10
            waiting = asyncio.create_task(store.create(record("later")))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # held while a replica is missing
        finally:
            ha.resume(stalled)
        assert await waiting is Created.NEW
        await adapters.save("sql", "/adapters/sql")
        assert await store.create(record("held")) is Created.EXISTS  # a retry attaches
        await store.close()

    asyncio.run(go())
    for node in ha.replicas():
        replica = redis.Redis(host="127.0.0.1", port=node.port)
        assert replica.exists("llmserve:request:later", "llmserve:abort:unknown") == 2
        assert replica.hget(LORA_ADAPTERS_KEY, "sql") == b"/adapters/sql"


@pytest.mark.parametrize("min_replicas", [0, 1])
def test_a_request_accepted_before_a_failover_is_on_the_promoted_replica(ha, min_replicas):
    """Replication is cut (the replicas cannot re-sync: wrong `masterauth`) when a request
    arrives, then the primary is killed -9. With --redis-min-replicas 1 the request is never
    accepted (held, then refused: the client retries on the new primary); with 0 it is
    accepted and the promoted replica lacks it: the loss the barrier prevents."""
    replicas = [redis.Redis(host="127.0.0.1", port=n.port) for n in ha.replicas()]
    for r in replicas:
        r.config_set("masterauth", "not-the-password")
    ha.primary_client().client_kill_filter(_type="replica")

    async def create() -> Created | None:
        store = RequestStore(target(ha), min_replicas=min_replicas, replica_timeout_ms=100)
        store.create_hold_s = 0.5
        try:
            return await store.create(record("acc"))
        except StoreUnavailable:
            return None
        finally:
            await store.close()

    accepted = asyncio.run(create())
    old = ha.kill_primary()
    for r in replicas:
        r.config_set("masterauth", "")
    ha.wait_failover(old)
    stored = ha.primary_client().exists("llmserve:request:acc")
    if min_replicas:
        assert accepted is None and not stored
    else:
        assert accepted is Created.NEW and not stored
