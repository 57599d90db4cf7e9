"""Per-request deadlines on the scheduler's hooks: a request that waits or runs past its
deadline ends.

A deadline is absolute (epoch seconds: arrival time plus the earliest of the request's own
timeout, its gRPC call's remaining time and the server's --request-timeout; ``handle_fields``
gives the handle the timeout, RequestHandle adds it to its arrival time). It is stored with the
request in Redis (``stored_fields`` -> ``StoredRequest.deadline``), so a recovered request keeps
the deadline it arrived with: a scheduler crash never restarts the clock. ``admit`` puts new and
recovered requests alike on the heap.

The check runs once per engine step per executor (``between_steps``, with the executor's lock
held), never per token: a heap ordered by deadline makes the common case (nothing due) one
comparison. A request ended here finishes as FINISHED_DEADLINE with the tokens it had; one that
had produced none ends its Generate call with DEADLINE_EXCEEDED (api/servicer.py).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, Metric

from scheduler_svc.core.request import RequestStatus
from scheduler_svc.engine.streams import EngineStep, RequestHandle
from scheduler_svc.features.base import Feature
from scheduler_svc.features.deadlines.timeouts import request_timeout

log = structlog.get_logger(__name__)

__all__ = ["DeadlineHeap", "Deadlines"]

_MIN_COMPACT = 1024  # heap entries below which stale ones are never worth a pass


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


class Deadlines(Feature):
    """Ends the requests whose deadline has passed, between two steps of their executor."""

    name = "deadlines"

    def __init__(self, server_timeout_s: float | None, table: Any, persister: Any) -> None:
        self.server_timeout_s = server_timeout_s  # --request-timeout; None = off
        self.table = table  # engine.request_table.RequestTable: the requests held
        self.persister = persister  # state.persister.Persister: a step's writes go there
        self.heap = DeadlineHeap()
        # Due, but held by another executor when found: that executor's next check ends them.
        self._overdue: list[RequestHandle] = []
        # Requests ended by their deadline, by where they were then ("waiting", "running").
        self.exceeded: dict[str, int] = {}

    def handle_fields(self, inp: Any) -> dict[str, Any]:
        timeout_s = request_timeout(inp, self.server_timeout_s)
        return {} if timeout_s is None else {"timeout_s": timeout_s}

    def stored_fields(self, handle: RequestHandle) -> dict[str, Any]:
        return {"deadline": handle.deadline}

    def admit(self, handle: RequestHandle) -> None:
        self.heap.push(handle)
        # Requests that finish before their deadline leave their entry behind; with a long
        # server default those would pile up, so past twice the requests held (amortised
        # O(1) per push) the heap keeps only the held ones (and this one, not yet in the
        # table: admit runs just before it is added).
        if len(self.heap) > 2 * len(self.table) + _MIN_COMPACT:
            self.heap.keep(lambda req_id: req_id in self.table or req_id == handle.req_id)

    def holds_ahead(self, ex: Any) -> bool:
        """Whether `ex` may hold a request past its deadline (then it plans no step ahead, so
        that its next check comes after the step in flight). Overdue requests of other
        executors (one that is down, say) do not hold it back."""
        return self.heap.due(time.time()) or any(h.executor is ex for h in self._overdue)

    def between_steps(self, ex: Any) -> None:
        """End `ex`'s requests that are past their deadline (its lock held, between steps)."""
        if not self.holds_ahead(ex):
            return
        mine = self._take(ex, time.time())
        if not mine:
            return
        record = EngineStep()
        for handle in mine:
            self._end(ex, handle, record)
        self.persister.submit(record)

    def _take(self, ex: Any, now: float) -> list[RequestHandle]:
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

    def _end(self, ex: Any, handle: RequestHandle, record: EngineStep) -> None:
        phase = "waiting" if handle.scheduled_time is None else "running"
        ex.sched.abort_request(handle.req_id)  # frees its blocks; the executor drops it
        for index in range(handle.n):  # sequences that had finished keep their own reason
            handle.finish_seq(index, RequestStatus.FINISHED_DEADLINE, None, record)
        self.table.finish(handle, record)
        self.exceeded[phase] = self.exceeded.get(phase, 0) + 1
        log.info(
            "request.deadline_exceeded",
            req_id=handle.req_id,
            phase=phase,
            late_s=round(time.time() - handle.deadline, 3),
        )

    def metrics(self, model: str, cores: list[Any], stats: list[Any]) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "llmserve:request_deadline_exceeded",
            "Requests ended by their deadline, by whether they had been scheduled.",
            labels=["model_name", "phase"],
        )
        for phase, count in sorted(self.exceeded.items()):
            family.add_metric([model, phase], count)
        yield family
