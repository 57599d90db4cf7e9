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

import structlog

from scheduler_svc.engine.faults.lifecycle import Lifecycle
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.fleet.executors import ExecutorPool
from scheduler_svc.state.persister import Persister
from scheduler_svc.state.store import RequestStore

log = structlog.get_logger(__name__)

__all__ = ["HealthMonitor"]


class HealthMonitor:
    def __init__(
        self,
        lifecycle: Lifecycle,
        pool: ExecutorPool,
        store: RequestStore,
        persister: Persister,
        *,
        interval_s: float = 0.5,
        probe_timeout_s: float = 2.0,
    ) -> None:
        self.lifecycle = lifecycle
        self.pool = pool
        self.store = store
        self.persister = persister
        self.on_change: Callable[[bool], None] = lambda serving: None
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.serving = False
        self.reason = "starting"
        self.redis_error: str | None = None
        self._published: bool | None = None

    async def run(self) -> None:
        # Ends on its own once the engine stops, not only when cancelled: a cancellation that
        # arrived during the Redis probe was once swallowed there, and stop() then waited on
        # this loop for good (a scheduler outliving its SIGTERM in CI).
        while not self.lifecycle.stopping:
            await self.check()
            await asyncio.sleep(self.interval_s)

    async def check(self) -> None:
        """Probe Redis and the idle executors once, then publish the verdict."""
        self.redis_error = await self.store.probe_write()
        if self.lifecycle.serving:
            await asyncio.gather(*(self._probe(ex) for ex in list(self.pool.executors)))
        self.update()

    def update(self) -> None:
        """Publish the verdict from what is known now (cheap; called on every change)."""
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
        if (reason := self.lifecycle.why_not_serving()) is not None:
            return reason
        if self.redis_error is not None:
            return f"Redis refuses writes: {self.redis_error}"
        if not self.persister.healthy:
            return self.persister.replication_shortfall or "Redis refuses writes"
        if not any(ex.healthy for ex in self.pool.executors):
            return "no executor is reachable"
        return None

    async def _probe(self, ex: ExecutorHandle) -> None:
        if not ex.healthy or not ex.idle:
            return  # a busy executor's steps tell; an unhealthy one is being reconnected
        reason = await self.pool.probe(ex, self.probe_timeout_s)
        if reason is not None and ex.healthy:
            await self.pool.lose(ex, reason)
