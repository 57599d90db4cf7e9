"""Where the scheduler's Redis connections come from: one plain server, or Sentinel's primary.

Every connection of the scheduler (request store, persister, adapter registry, leader lease) is
made here, so a deployment changes in one place:
- plain: `--redis-url redis://host:port/db` (or rediss:// for TLS), exactly as before;
- Sentinel: `--redis-sentinel host:port,host:port,...` and `--redis-sentinel-master NAME`. The
  connection asks the Sentinels for the current primary whenever it (re)connects: redis-py's
  `SentinelConnectionPool` drops idle connections when the primary's address changes, and a
  connection that meets READONLY (it still talks to a demoted primary) is closed and fails as a
  connection error, which every caller already treats as "Redis unavailable, retry". A retry
  then reconnects through the Sentinels, so a killed or demoted primary is never written again.
  `--redis-url` then carries only the data nodes' credentials, database and TLS (its host is
  ignored); Sentinel's own password is `LLMSERVE_REDIS_SENTINEL_PASSWORD`, and with rediss:// the
  Sentinels are reached over TLS with the same settings.

`wait_replicas` is the write barrier behind `--redis-min-replicas` (docs/deployment.md): one
small write, then `WAIT` on the same connection. Redis replicates in one ordered stream, so the
replicas that acknowledge the barrier hold every write any connection made before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.connection import SSLConnection, parse_url

__all__ = [
    "BARRIER_KEY",
    "RedisTarget",
    "connect",
    "execute_acknowledged",
    "parse_sentinels",
    "wait_replicas",
]

# Written (INCR) by every barrier: a write the replicas must acknowledge.
BARRIER_KEY = "llmserve:replication:barrier"


def parse_sentinels(text: str) -> tuple[tuple[str, int], ...]:
    """`host:port[,host:port...]` as (host, port) pairs; ValueError names a bad entry."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"a Sentinel address is host:port, not {part!r}")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("no Sentinel address given")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Which Redis holds the state. With `sentinels`, `url` gives only credentials, db and TLS."""

    url: str = "redis://127.0.0.1:6379/0"
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = "mymaster"
    sentinel_password: str | None = None

    @property
    def uses_sentinel(self) -> bool:
        return bool(self.sentinels)

    def describe(self) -> str:
        """For logs: never the password."""
        if not self.sentinels:
            return self.url.split("@")[-1]
        return f"sentinel:{self.master}@" + ",".join(f"{h}:{p}" for h, p in self.sentinels)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel discovery with a bounded pool that waits for a free connection (as the plain
    store's BlockingConnectionPool does) instead of refusing call number `max_connections`."""


def connect(
    target: RedisTarget | str,
    *,
    timeout_s: float,
    max_connections: int | None = None,
    **kwargs: Any,
) -> aioredis.Redis:
    """An asyncio client of the target's primary. With `max_connections` the pool blocks (up to
    `timeout_s`) for a free connection; other keyword arguments go to every connection."""
    if isinstance(target, str):
        target = RedisTarget(url=target)
    kwargs = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, **kwargs}
    if max_connections is not None:
        kwargs.update(max_connections=max_connections, timeout=timeout_s)
    if not target.uses_sentinel:
        if max_connections is None:
            return aioredis.Redis.from_url(target.url, **kwargs)
        pool = aioredis.BlockingConnectionPool.from_url(target.url, **kwargs)
        return aioredis.Redis.from_pool(pool)  # closing it closes the pool
    node = _node_kwargs(target.url)
    sentinel_kwargs = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        **{k: v for k, v in node.items() if k.startswith("ssl")},
    }
    if target.sentinel_password:
        sentinel_kwargs["password"] = target.sentinel_password
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs, **node)
    pool_class = SentinelConnectionPool if max_connections is None else _BlockingSentinelPool
    return sentinel.master_for(target.master, connection_pool_class=pool_class, **kwargs)


def _node_kwargs(url: str) -> dict[str, Any]:
    """Connection settings of the data nodes from a URL, without its host and port (Sentinel
    names those); TLS as `ssl=True` plus the URL's ssl_* options."""
    parsed = parse_url(url)
    for key in ("host", "port", "path"):
        parsed.pop(key, None)
    if parsed.pop("connection_class", None) is SSLConnection:
        parsed["ssl"] = True
    return parsed


async def wait_replicas(client: aioredis.Redis, num_replicas: int, timeout_ms: int) -> int:
    """How many replicas acknowledged every write made so far (by any connection), waiting
    up to `timeout_ms` for `num_replicas` of them. One round trip: the barrier write and WAIT
    go out pipelined on one connection (WAIT counts that connection's own last write)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.incr(BARRIER_KEY)
        pipe.execute_command("WAIT", num_replicas, timeout_ms)
        _, acked = await pipe.execute()
    return int(acked)


async def execute_acknowledged(
    pipe: Any, num_replicas: int, timeout_ms: int
) -> tuple[list[Any], int]:
    """Execute the writes queued on `pipe` with `WAIT num_replicas timeout_ms` after them on the
    same connection (one round trip): their results, and how many replicas hold them. On the
    same connection because a WAIT sent after a failover reaches the new primary, whose replicas
    may never have seen what the old one took. With num_replicas 0 no WAIT is sent (0 acked)."""
    if num_replicas:
        pipe.execute_command("WAIT", num_replicas, timeout_ms)
    # The first error as Redis sent it (a pipeline would reword it: FENCED, NOSCRIPT).
    results = await pipe.execute(raise_on_error=False)
    error = next((r for r in results if isinstance(r, Exception)), None)
    if error is not None:
        raise error
    if not num_replicas:
        return results, 0
    return results[:-1], int(results[-1])
