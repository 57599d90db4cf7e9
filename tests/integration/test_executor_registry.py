"""The executor registry contract (protos/executor_registry.md): what the executor side writes
is exactly what the scheduler side reads, with real Redis. The two services share no code for
it, so this test is where they meet."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from executor_svc.api.registry import EXECUTORS_KEY, ExecutorRegistration, executor_key
from scheduler_svc.state import store

CONTRACT = Path(__file__).resolve().parents[2] / "protos" / "executor_registry.md"


def listed(redis_url: str) -> list[tuple[str, str]]:
    async def go():
        s = store.RequestStore(redis_url)
        try:
            return await s.list_executors()
        finally:
            await s.close()

    return asyncio.run(go())


def test_both_sides_use_the_keys_the_contract_names():
    text = CONTRACT.read_text()
    assert EXECUTORS_KEY == store.EXECUTORS_KEY == "llmserve:index:executors"
    assert f"`{EXECUTORS_KEY}`" in text
    assert (
        executor_key("ID") == "llmserve:executor:ID" and "`llmserve:executor:<instance_id>`" in text
    )


def test_what_an_executor_announces_a_scheduler_finds_and_a_clean_stop_removes(redis_url):
    reg = ExecutorRegistration(redis_url, "ex-a", "10.0.0.5:50061", interval_s=0.1)
    reg.start()
    try:
        assert reg.healthy
        assert listed(redis_url) == [("ex-a", "10.0.0.5:50061")]
        time.sleep(0.35)  # several heartbeats: still one entry
        assert listed(redis_url) == [("ex-a", "10.0.0.5:50061")]
    finally:
        reg.stop()
    assert listed(redis_url) == []
    raw = redis.Redis.from_url(redis_url)
    assert not raw.exists(executor_key("ex-a")) and not raw.smembers(EXECUTORS_KEY)


def test_registry_entries_expire_without_heartbeat(redis_url):
    reg = ExecutorRegistration(redis_url, "ex1", "10.0.0.7:50061", ttl_s=0.3, interval_s=60)
    assert reg.beat() and reg.healthy  # one heartbeat, then silence (as if killed)
    assert listed(redis_url) == [("ex1", "10.0.0.7:50061")]
    time.sleep(0.5)
    assert listed(redis_url) == []
    assert not redis.Redis.from_url(redis_url).smembers(EXECUTORS_KEY)  # the reader cleaned up


def test_a_reader_ignores_fields_it_does_not_know(redis_url):
    raw = redis.Redis.from_url(redis_url)
    raw.set(executor_key("ex-new"), '{"address": "h:1", "zone": "b"}', px=5000)
    raw.sadd(EXECUTORS_KEY, "ex-new")
    assert listed(redis_url) == [("ex-new", "h:1")]
