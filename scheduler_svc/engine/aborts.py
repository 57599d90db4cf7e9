"""Abort by id: it wins every race with the request's own Generate, and answers only once final.

Where the id is when the abort arrives decides what it does:

- held in memory (waiting, running, swapped): ended between two steps of its executor;
- being claimed in Redis by a Generate right now (`CreatingIds`): wait for the claim to
  settle, then as above;
- unknown: `store.abort_ahead` leaves a tombstone in Redis that the Generate's claim meets
  (both are scripts, so Redis orders them), and that request is stored finished as aborted.
  Being in Redis, a tombstone holds across a restart and for a new leader too.

An abort returns only once its finish is in Redis and published (`Persister.acknowledged`):
from then on every read (GetRequest, Resume, a stream) shows the request finished as aborted,
on this scheduler or after a crash. The engine loop never waits for it: the abort holds the
executor's lock only to apply the change in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import structlog

from scheduler_svc.core.errors import Unavailable
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.engine.config import AbortOutcome, public_id
from scheduler_svc.engine.faults.lifecycle import Lifecycle
from scheduler_svc.engine.request_table import RequestTable
from scheduler_svc.engine.streams import EngineStep, RequestHandle
from scheduler_svc.state.persister import Persister
from scheduler_svc.state.store import RequestStore, StoreFenced, StoreUnavailable

log = structlog.get_logger(__name__)

__all__ = ["ACK_TIMEOUT_S", "Aborts", "CreatingIds"]

# How long an abort that has taken effect in memory waits for Redis to hold it before it
# answers UNAVAILABLE instead (Redis down, or this scheduler deposed: the client retries, and
# the request it finds then, here or on the next leader, is aborted at that point).
ACK_TIMEOUT_S = 10.0
# An id stored as active but held nowhere in memory can only be a Generate whose claim went
# through between two looks; one more look finds it. Past this the state is not ours.
_MAX_LOOKS = 4


class CreatingIds:
    """Ids whose Generate is claiming them in Redis right now (between its `store.create`
    call and the handle's registration in the request table): an abort of such an id waits
    for the claim to settle instead of racing it."""

    def __init__(self) -> None:
        self._ids: dict[str, tuple[int, asyncio.Event]] = {}

    @contextlib.contextmanager
    def hold(self, req_id: str) -> Iterator[None]:
        count, settled = self._ids.get(req_id, (0, None))
        self._ids[req_id] = (count + 1, settled or asyncio.Event())
        try:
            yield
        finally:
            count, settled = self._ids[req_id]
            if count == 1:
                del self._ids[req_id]
                settled.set()
            else:
                self._ids[req_id] = (count - 1, settled)

    async def settled(self, req_id: str) -> bool:
        """Wait until no Generate is claiming `req_id`; False when none was."""
        entry = self._ids.get(req_id)
        if entry is None:
            return False
        await entry[1].wait()
        return True


class Aborts:
    def __init__(
        self,
        lifecycle: Lifecycle,
        table: RequestTable,
        store: RequestStore,
        persister: Persister,
        abort_ahead_ttl_s: float,
    ) -> None:
        self.lifecycle = lifecycle
        self.table = table
        self.store = store
        self.persister = persister
        self.abort_ahead_ttl_s = abort_ahead_ttl_s
        self.creating = CreatingIds()  # held by submit while it claims an id in Redis

    async def abort(self, req_id: str, *, missing_ok: bool = False) -> AbortOutcome:
        """Abort `req_id` (scoped to its owner's key: another key's request is never found).

        `missing_ok`: a stream of this scheduler that went away; it leaves no tombstone.
        """
        # While stopping the state is still whole: aborts go on.
        if not (self.lifecycle.serving or self.lifecycle.stopping):
            if missing_ok:  # a stream that went away during start-up: nothing of it runs yet
                return AbortOutcome.NOT_ACTIVE
            self.lifecycle.check()
        for _ in range(_MAX_LOOKS):
            handle = self.table.get(req_id)
            if handle is not None:
                aborted = await self._end_held(handle)
                await self._acknowledged()
                return AbortOutcome.ABORTED if aborted else AbortOutcome.NOT_ACTIVE
            if missing_ok:
                return AbortOutcome.NOT_ACTIVE
            if await self.creating.settled(req_id):
                continue  # registered now (or its claim failed): look again
            status = await self._abort_ahead(req_id)
            if status is None:
                log.info("request.aborted_ahead", req_id=req_id)
                return AbortOutcome.PENDING
            if status == "finished":
                return AbortOutcome.NOT_ACTIVE
            # "active": a Generate's claim reached Redis between our look and our script.
        raise Unavailable(
            f"request {public_id(req_id)!r} is stored but not running on this scheduler; retry"
        )

    async def _abort_ahead(self, req_id: str) -> str | None:
        """Leave a tombstone for an id held nowhere (see the module docstring)."""
        try:
            return await self.store.abort_ahead(req_id, self.abort_ahead_ttl_s)
        except StoreFenced as e:
            self.lifecycle.lose_leadership(f"a write was refused: {e}")
            raise Unavailable("this scheduler is no longer the leader; retry") from e
        except StoreUnavailable as e:
            raise Unavailable("request store (Redis) is unavailable") from e

    async def _end_held(self, handle: RequestHandle) -> bool:
        """End a request held in memory, between two steps of its executor; False when it had
        finished already."""
        while True:
            ex = handle.executor
            async with ex.exclusive():  # never in the middle of this executor's step
                if handle.finished_in_engine:
                    return False
                if handle.executor is not ex:
                    continue  # moved (fail-over, draining) while we waited: abort it there
                ex.sched.abort_request(handle.req_id)
                record = EngineStep()
                for index in range(handle.n):
                    handle.finish_seq(index, RequestStatus.FINISHED_ABORTED, None, record)
                self.table.finish(handle, record)
                self.persister.submit(record)
            ex.wake.set()
            log.info("request.aborted", req_id=handle.req_id)
            return True

    async def _acknowledged(self) -> None:
        """Wait until what the abort (or the step that finished the request first) wrote is in
        Redis and published, so that no read after the answer sees the request still active."""
        try:
            await asyncio.wait_for(self.persister.acknowledged(), ACK_TIMEOUT_S)
        except TimeoutError as e:
            raise Unavailable(
                "the abort is applied but the request store (Redis) has not acknowledged it; retry"
            ) from e
