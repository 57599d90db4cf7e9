"""Live-loaded adapters kept in Redis, so that a restarted scheduler still serves them.

Layout: the hash ``llmserve:lora_adapters``, adapter name -> PEFT directory (the resolved path).
LoadLoraAdapter writes an entry once every executor took the adapter, UnloadLoraAdapter deletes
it, and a starting scheduler merges the hash into its ``--lora-modules`` registry (a name given
on the command line keeps the command line's path). Adapters from ``--lora-modules`` are not
written: the command line is their durable record.
"""

from __future__ import annotations

import asyncio

import structlog
from redis.exceptions import RedisError

from scheduler_svc.core.errors import NotFound, ValidationError
from scheduler_svc.features.lora.registry import LoraRegistry
from scheduler_svc.state.connect import execute_acknowledged
from scheduler_svc.state.store import RequestStore, StoreUnavailable

LORA_ADAPTERS_KEY = "llmserve:lora_adapters"

log = structlog.get_logger(__name__)


class LoraAdapterStore:
    """The ``llmserve:lora_adapters`` hash, on the request store's Redis connection.

    A client told that an adapter is loaded (or unloaded) may use it (or count on it being
    gone) on the next leader too, so with --redis-min-replicas each change is acknowledged by
    that many replicas before the answer, like a step's tokens: an unacknowledged one raises
    StoreUnavailable and the client is told to retry (the write is idempotent)."""

    def __init__(self, store: RequestStore) -> None:
        self._store = store
        self._redis = store.redis

    async def save(self, name: str, path: str) -> None:
        await self._write("HSET", LORA_ADAPTERS_KEY, name, path)

    async def delete(self, name: str) -> None:
        await self._write("HDEL", LORA_ADAPTERS_KEY, name)

    async def _write(self, *command: str) -> None:
        store = self._store
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.execute_command(*command)
                _, acked = await execute_acknowledged(
                    pipe, store.min_replicas, store.replica_timeout_ms
                )
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis unavailable: {e}") from e
        if acked < store.min_replicas and not store.release_unreplicated:
            raise StoreUnavailable(
                f"{acked} of {store.min_replicas} Redis replicas acknowledged the change"
            )

    async def load_all(self) -> dict[str, str]:
        try:
            raw = await self._redis.hgetall(LORA_ADAPTERS_KEY)
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis unavailable: {e}") from e
        return {k.decode(): v.decode() for k, v in raw.items()}


async def restore_live_adapters(adapters: LoraAdapterStore, registry: LoraRegistry) -> int:
    """Register the stored live adapters that ``--lora-modules`` did not name; one that cannot
    be read any more (its directory gone or changed) is logged and left out. Returns how many
    were registered."""
    while True:
        try:
            stored = await adapters.load_all()
            break
        except StoreUnavailable:
            log.warning("lora.restore.waiting_for_store")
            await asyncio.sleep(0.5)
    restored = 0
    for name, path in sorted(stored.items()):
        if registry.has(name):
            continue  # the command line names it: its path wins
        try:
            registry.load(name, path)
        except (NotFound, ValidationError) as e:
            log.warning("lora.restore_failed", name=name, path=path, error=str(e))
            continue
        restored += 1
    if restored:
        log.info("lora.restored", adapters=restored)
    return restored
