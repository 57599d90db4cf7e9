"""Where the executor's Redis connection comes from (the registry heartbeat is its only user).

The executor shares no code with the scheduler (only protos), so this mirrors the scheduler's
scheduler_svc/state/connect.py for a synchronous client: a plain `--redis-url`, or with
`--redis-sentinel` the primary the Sentinels name, followed across failovers by redis-py's
`SentinelConnectionPool` (a heartbeat that fails reconnects through the Sentinels on its next
beat). With Sentinels, the URL gives only credentials, db and TLS.
frontend_svc/batch/redis_conn.py is its asyncio twin, a copy on purpose: services may share only
protos, not each other's code.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.connection import SSLConnection, parse_url
from redis.sentinel import Sentinel

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
    timeout_s: float = 2.0,
) -> redis.Redis:
    """A client of the plain Redis at `url`, or of the primary named `master` by `sentinels`."""
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if not sentinels:
        if not url:
            raise ValueError("a Redis URL or Sentinels are needed")
        return redis.Redis.from_url(url, **timeouts)
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
