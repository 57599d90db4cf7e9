"""The frontend's Redis connection (the batch store's only one): `--redis-url`, or with
`--redis-sentinel` the primary the Sentinels name, followed across failovers by redis-py's
`SentinelConnectionPool`. The frontend shares no code with the scheduler (it is a client of its
public API), so this mirrors scheduler_svc/state/connect.py for the few options the store needs;
with Sentinels the URL gives only credentials, db and TLS, as there. executor_svc/api/redis_conn.py
is its synchronous twin, a copy on purpose: services may share only protos, not each other's code."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.connection import SSLConnection, parse_url

__all__ = ["connect", "parse_sentinels"]


def parse_sentinels(text: str) -> tuple[tuple[str, int], ...]:
    """`host:port[,host:port...]` as (host, port) pairs; ValueError names a bad entry."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        host, sep, port = part.rpartition(":")
        if part and (not sep or not host or not port.isdigit()):
            raise ValueError(f"a Sentinel address is host:port, not {part!r}")
        if part:
            out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("no Sentinel address given")
    return tuple(out)


def connect(
    url: str | None,
    sentinels: tuple[tuple[str, int], ...] = (),
    master: str = "mymaster",
    *,
    sentinel_password: str | None = None,
    timeout_s: float = 5.0,
) -> aioredis.Redis:
    """An asyncio client of the plain Redis at `url`, or of the primary `master` of `sentinels`."""
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if not sentinels:
        if not url:
            raise ValueError("a Redis URL or Sentinels are needed")
        return aioredis.Redis.from_url(url, **timeouts)
    node: dict[str, Any] = parse_url(url or "redis://")
    for key in ("host", "port", "path"):
        node.pop(key, None)
    if node.pop("connection_class", None) is SSLConnection:
        node["ssl"] = True
    sentinel_kwargs = {**timeouts, **{k: v for k, v in node.items() if k.startswith("ssl")}}
    if sentinel_password:
        sentinel_kwargs["password"] = sentinel_password
    sentinel = Sentinel(list(sentinels), sentinel_kwargs=sentinel_kwargs, **node)
    return sentinel.master_for(master, **timeouts)
