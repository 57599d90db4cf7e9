"""Writes each engine step's output to Redis off the engine loop, then releases it to clients.

Steps are written strictly in order by one task. A step's tokens reach client streams only
after Redis acknowledged them (`on_ack` runs after the write), so nothing a client has seen can
be lost. While Redis is down, steps queue up (the engine pauses once the backlog passes its
bound) and are written, coalesced, as soon as it returns.

With `--redis-min-replicas N` "acknowledged" means: the primary and N replicas hold it. After
each batched write one barrier (`RequestStore.replicate`: a write and `WAIT`) waits for them;
until they answer the batch stays queued exactly as in an outage (streams held, health says
why), unless the store releases unreplicated writes (`--redis-degrade-unreplicated`). Sentinel
promotes the most up-to-date reachable replica, so after a failover the new primary holds every
token any client was sent (docs/redis-ha.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from scheduler_svc.state.store import (
    FinishRecord,
    RequestStore,
    StoreFenced,
    StoreGapError,
    StoreUnavailable,
    TokenAppend,
)

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class StepRecord:
    """What one step writes; the engine's own record (engine/streams.EngineStep) extends it
    with what it publishes to clients once Redis has it."""

    appends: list[TokenAppend] = field(default_factory=list)
    finishes: list[FinishRecord] = field(default_factory=list)
    on_ack: Callable[[], None] | None = None  # run once acknowledged
    # (request id, JSON entries) of requests whose prompt logprobs completed this step.
    prompt_logprobs: list[tuple[str, list[Any]]] = field(default_factory=list)

    def is_empty(self) -> bool:
        """Nothing to write and nothing to run once written: not worth queueing."""
        return not self.appends and not self.finishes and self.on_ack is None

    def acknowledged(self) -> None:
        """Redis holds this record and every one queued before it."""
        if self.on_ack is not None:
            self.on_ack()


@dataclass(slots=True)
class PersisterStats:
    num_writes: int = 0
    num_steps: int = 0
    num_ops: int = 0
    write_time_s: float = 0.0
    num_failures: int = 0
    num_unreplicated: int = 0  # barriers that fewer than min_replicas acknowledged in time


class Persister:
    def __init__(
        self,
        store: RequestStore,
        *,
        max_backlog_steps: int = 1024,
        resync: Callable[[], Awaitable[None]] | None = None,
        retry_interval_s: float = 0.2,
    ) -> None:
        self.store = store
        self.max_backlog_steps = max_backlog_steps
        self.retry_interval_s = retry_interval_s
        self._resync = resync
        self._queue: deque[StepRecord] = deque()
        self.on_write: Callable[[float], None] | None = None  # seconds of each Redis write
        # Called once when a write is fenced off (another scheduler leads); the writer stops.
        self.on_fenced: Callable[[str], None] | None = None
        self._has_work = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self.healthy = True
        # Replicas that acknowledged the last barrier (None: no barrier, min_replicas is 0).
        self.replicas_acked: int | None = None
        self.stats = PersisterStats()
        self._task: asyncio.Task | None = None

    @property
    def backlog(self) -> int:
        return len(self._queue)

    @property
    def over_backlog(self) -> bool:
        return len(self._queue) >= self.max_backlog_steps

    def submit(self, rec: StepRecord, *, wake: bool = True) -> None:
        """Queue a record. With wake=False it waits for the next kick() (or a later submit).

        The engine queues a step's record without waking the writer and kicks it once the next
        ExecuteModel is on its way: building and sending the Redis command then overlaps the
        executor's forward pass instead of delaying the next step.
        """
        if rec.is_empty():
            return
        self._queue.append(rec)
        self._drained.clear()
        if wake:
            self._has_work.set()

    def kick(self) -> None:
        """Wake the writer if anything is queued."""
        if self._queue:
            self._has_work.set()

    async def acknowledged(self) -> None:
        """Returns once every record submitted so far is in Redis and published: records are
        written and acknowledged in order, so an empty one queued now marks the point."""
        done = asyncio.get_running_loop().create_future()

        def ack() -> None:
            if not done.done():  # the waiter may have given up (cancelled) already
                done.set_result(None)

        self.submit(StepRecord(on_ack=ack))
        await done

    async def wait_drained(self) -> None:
        self.kick()
        await self._drained.wait()

    async def wait_below_backlog(self) -> None:
        self.kick()
        while self.over_backlog:
            await asyncio.sleep(self.retry_interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="persister")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._drained.set()
                self._has_work.clear()
                await self._has_work.wait()
                continue
            # Everything queued goes out in one round trip: after an outage the backlog is
            # flushed at once; in steady state this is exactly one step.
            batch = list(self._queue)
            appends = [a for r in batch for a in r.appends]
            finishes = [f for r in batch for f in r.finishes]
            prompt_lps = [p for r in batch for p in r.prompt_logprobs]
            t0 = time.perf_counter()
            try:
                await self.store.write_step(appends, finishes, prompt_lps)
                if not await self._replicated(len(batch)):
                    await asyncio.sleep(self.retry_interval_s)
                    continue  # held: written again (idempotent) with a fresh barrier
            except StoreFenced as e:
                # Not ours to write any more: nothing queued may ever go out.
                self.healthy = False
                if self.on_fenced is not None:
                    self.on_fenced(f"a write was refused: {e}")
                return
            except StoreGapError as e:
                # Redis lost acknowledged data (restarted without persistence): rewrite every
                # active request from memory, then retry the batch.
                log.error("store.gap", error=str(e))
                if self._resync is not None:
                    try:
                        await self._resync()
                        continue
                    except Exception as resync_error:  # retried below
                        e = resync_error
                self._failed(e, len(batch))
                await asyncio.sleep(self.retry_interval_s)
                continue
            except Exception as e:
                # Any failure (Redis down or refusing writes, or a bug) only pauses the writer:
                # the batch stays queued, streams wait, and it is retried until Redis takes it.
                # Letting the task die instead would stall every stream for good.
                self._failed(e, len(batch))
                await asyncio.sleep(self.retry_interval_s)
                continue
            if not self.healthy:
                log.info("store.recovered", flushed_steps=len(batch))
            self.healthy = True
            self.stats.num_writes += 1
            self.stats.num_steps += len(batch)
            self.stats.num_ops += len(appends) + len(finishes)
            elapsed = time.perf_counter() - t0
            self.stats.write_time_s += elapsed
            if self.on_write is not None:
                self.on_write(elapsed)
            for rec in [self._queue.popleft() for _ in batch]:
                try:
                    rec.acknowledged()
                except Exception:  # one bad publication must not stop the writer
                    log.exception("persister.publish_failed")

    async def _replicated(self, backlog: int) -> bool:
        """After a write: whether its effects may be released (enough replicas hold it, or
        the store releases what they do not)."""
        need = self.store.min_replicas
        if not need:
            return True
        acked = self.replicas_acked = await self.store.replicate()
        if acked >= need:
            return True
        self.stats.num_unreplicated += 1
        if self.store.release_unreplicated:
            log.warning("store.unreplicated_released", acked=acked, needed=need)
            return True
        if self.healthy:
            log.warning("store.unreplicated_held", acked=acked, needed=need, backlog=backlog)
        self.stats.num_failures += 1
        self.healthy = False
        return False

    @property
    def replication_shortfall(self) -> str | None:
        """Why the last barrier fell short, or None."""
        acked, need = self.replicas_acked, self.store.min_replicas
        if acked is None or acked >= need:
            return None
        return f"{acked} of {need} Redis replicas acknowledged the last write"

    def _failed(self, error: BaseException, backlog: int) -> None:
        """Note a failed write: logged once per outage (with the traceback when it is not a
        plain store outage), then retried quietly."""
        self.stats.num_failures += 1
        if self.healthy:
            if isinstance(error, StoreUnavailable):
                log.warning("store.unavailable", error=str(error), backlog=backlog)
            else:
                log.error("store.write_failed", error=repr(error), backlog=backlog, exc_info=error)
        self.healthy = False
