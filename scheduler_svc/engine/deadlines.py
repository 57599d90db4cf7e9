"""Per-request deadlines: a request that waits or runs past its deadline ends.

A deadline is absolute (epoch seconds: arrival time plus the earliest of the request's own
timeout, its gRPC call's remaining time and the server's --request-timeout). It is stored with
the request in Redis (`StoredRequest.deadline`), so a recovered request keeps the deadline it
arrived with: a scheduler crash never restarts the clock.

The check runs once per engine step per executor (`Deadlines.expire`, with the executor's lock
held, between two steps), never per token: a heap ordered by deadline makes the common case
(nothing due) one comparison. A request ended here finishes as FINISHED_DEADLINE with the tokens
it had; one that had produced none ends its Generate call with DEADLINE_EXCEEDED
(api/servicer.py).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from scheduler_svc.core.errors import ValidationError
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.engine.streams import EngineStep, RequestHandle

if TYPE_CHECKING:
    from scheduler_svc.engine.config import EngineConfig, GenerateInput
    from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
    from scheduler_svc.engine.metrics import EngineMetrics
    from scheduler_svc.engine.request_table import RequestTable
    from scheduler_svc.state.persister import Persister

log = structlog.get_logger(__name__)

__all__ = ["MAX_TIMEOUT_S", "DeadlineHeap", "Deadlines", "check_timeout", "request_deadline"]

# Longer than any generation, short enough that `arrival + timeout` stays an exact float and a
# typo (a timeout in milliseconds, say) is refused rather than meaning "never".
MAX_TIMEOUT_S = 7 * 24 * 3600.0
_MIN_COMPACT = 1024  # heap entries below which stale ones are never worth a pass


def check_timeout(value: float, what: str = "timeout_s") -> float:
    """`value` if it is a usable timeout in seconds, else ValidationError saying why."""
    if not math.isfinite(value) or value <= 0:
        raise ValidationError(f"{what} must be a positive number of seconds, got {value}")
    if value > MAX_TIMEOUT_S:
        raise ValidationError(f"{what} must be at most {MAX_TIMEOUT_S:.0f} seconds, got {value}")
    return value


def request_deadline(arrival_time: float, inp: GenerateInput, config: EngineConfig) -> float:
    """The absolute deadline: arrival plus the shortest of the request's timeouts and the
    server's default; 0.0 when there is none."""
    given = [t for t in (config.request_timeout_s, *inp.timeouts) if t is not None]
    return arrival_time + min(given) if given else 0.0


class DeadlineHeap:
    """Request ids by deadline, earliest first. Entries are never removed early: a finished or
    forgotten request's entry is skipped when it comes up (cheaper than removal)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, handle: RequestHandle) -> None:
        if handle.deadline:
            heapq.heappush(self._heap, (handle.deadline, handle.req_id))

    def due(self, now: float) -> bool:
        return bool(self._heap) and self._heap[0][0] <= now

    def keep(self, wanted: Callable[[str], bool]) -> None:
        """Drop the entries of requests not `wanted` (finished ones), in O(n)."""
        self._heap = [e for e in self._heap if wanted(e[1])]
        heapq.heapify(self._heap)

    def pop_due(self, now: float) -> list[str]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[1])
        return out


class Deadlines:
    """Ends the requests whose deadline has passed, between two steps of their executor."""

    def __init__(self, table: RequestTable, persister: Persister, metrics: EngineMetrics) -> None:
        self.table = table
        self.persister = persister
        self.metrics = metrics
        self.heap = DeadlineHeap()
        table.on_add.append(self._add)  # admitted and recovered requests alike
        # Due, but held by another executor when found: that executor's next check ends them.
        self._overdue: list[RequestHandle] = []

    def _add(self, handle: RequestHandle) -> None:
        self.heap.push(handle)
        # Requests that finish before their deadline leave their entry behind; with a long
        # server default those would pile up, so past twice the requests held (amortised
        # O(1) per push) the heap keeps only the held ones.
        if len(self.heap) > 2 * len(self.table) + _MIN_COMPACT:
            self.heap.keep(self.table.__contains__)

    def due(self, ex: ExecutorHandle) -> bool:
        """Whether `ex` may hold a request past its deadline (then it plans no step ahead, so
        that its next check comes after the step in flight). Overdue requests of other
        executors (one that is down, say) do not hold it back."""
        return self.heap.due(time.time()) or any(h.executor is ex for h in self._overdue)

    def expire(self, ex: ExecutorHandle) -> None:
        """End `ex`'s requests that are past their deadline (its lock held, between steps)."""
        if not self.due(ex):
            return
        mine = self._take(ex, time.time())
        if not mine:
            return
        record = EngineStep()
        for handle in mine:
            self._end(ex, handle, record)
        self.persister.submit(record)

    def _take(self, ex: ExecutorHandle, now: float) -> list[RequestHandle]:
        found = list(self._overdue)
        for req_id in self.heap.pop_due(now):
            handle = self.table.get(req_id)
            if handle is not None:
                found.append(handle)
        mine, self._overdue = [], []
        for handle in found:
            if handle.finished_in_engine:
                continue
            if handle.executor is ex:
                mine.append(handle)
            else:
                self._overdue.append(handle)
                if handle.executor is not None:
                    handle.executor.wake.set()
        return mine

    def _end(self, ex: ExecutorHandle, handle: RequestHandle, record: EngineStep) -> None:
        phase = "waiting" if handle.scheduled_time is None else "running"
        ex.sched.abort_request(handle.req_id)  # frees its blocks; the executor drops it
        for index in range(handle.n):  # sequences that had finished keep their own reason
            handle.finish_seq(index, RequestStatus.FINISHED_DEADLINE, None, record)
        self.table.finish(handle, record)
        self.metrics.deadline_exceeded[phase] = self.metrics.deadline_exceeded.get(phase, 0) + 1
        log.info(
            "request.deadline_exceeded",
            req_id=handle.req_id,
            phase=phase,
            late_s=round(time.time() - handle.deadline, 3),
        )
