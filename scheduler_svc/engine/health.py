"""The scheduler's health, kept truthful: SERVING only while it can actually do its job.

That takes a ready engine (start-up and recovery done, not stopping), a Redis that accepts
writes (a Redis that answers PING may still refuse every write) and at least one reachable
executor. A busy executor shows a failure in its next step; an idle one is asked for `Describe`
here, which also notices one that restarted while idle (its KV cache, and with it every cached
prefix the scheduler remembers for it, is gone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from scheduler_svc.engine.engine import Engine

log = structlog.get_logger(__name__)

__all__ = ["HealthMonitor"]


class HealthMonitor:
    def __init__(
        self,
        engine: Engine,
        on_change: Callable[[bool], None],
        *,
        interval_s: float = 0.5,
        probe_timeout_s: float = 2.0,
    ) -> None:
        self.engine = engine
        self.on_change = on_change
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.serving = False
        self.reason = "starting"
        self.redis_error: str | None = None
        self._published: bool | None = None

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)

    async def check(self) -> None:
        """Probe Redis and the idle executors once, then publish the verdict."""
        self.redis_error = await self.engine.store.probe_write()
        if self.engine.ready:
            await asyncio.gather(*(self._probe(ex) for ex in list(self.engine.executors)))
        self.update()

    def update(self) -> None:
        """Publish the verdict from what is known now (cheap; the engine calls it on changes)."""
        reason = self._why_not_serving()
        serving = reason is None
        changed = serving != self.serving or self._published is None
        if serving != self.serving:
            if serving:
                log.info("health.serving")
            else:
                log.warning("health.not_serving", reason=reason)
        self.serving, self.reason = serving, reason or ""
        if changed:  # health watchers get a message per set(): only on a change
            self._published = serving
            self.on_change(serving)

    def _why_not_serving(self) -> str | None:
        engine = self.engine
        if engine.standby:
            return "standby: another scheduler holds the leader lease"
        if engine.lost_leadership is not None:
            return f"no longer the leader: {engine.lost_leadership}"
        if engine.stopping:
            return "shutting down"
        if not engine.ready:
            return "starting: connecting executors and recovering requests"
        if self.redis_error is not None:
            return f"Redis refuses writes: {self.redis_error}"
        if not engine.persister.healthy:
            return "Redis refuses writes"
        if not any(ex.healthy for ex in engine.executors):
            return "no executor is reachable"
        return None

    async def _probe(self, ex) -> None:
        if not ex.healthy or not ex.idle:
            return  # a busy executor's steps tell; an unhealthy one is being reconnected
        reason = await self.engine.pool.probe(ex, self.probe_timeout_s)
        if reason is not None and ex.healthy:
            await self.engine.executor_lost(ex, reason)
