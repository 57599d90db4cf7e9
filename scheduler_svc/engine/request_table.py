"""The requests this engine holds, and what holding one means: per-key usage and metrics from
admission to finish.

A request is held from admission (or recovery) until Redis has acknowledged its finish: until
then it must stay resumable from memory. Only this table adds and drops entries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import structlog

from scheduler_svc import tracing
from scheduler_svc.core.request import RequestStatus, req_id_of
from scheduler_svc.core.scheduler_output import NewSeqData
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.key_usage import KeyUsage
from scheduler_svc.engine.metrics import EngineMetrics
from scheduler_svc.engine.streams import EngineStep, RequestHandle

log = structlog.get_logger(__name__)

__all__ = ["RequestTable"]


class RequestTable:
    def __init__(self, usage: KeyUsage, metrics: EngineMetrics) -> None:
        self.usage = usage
        self.metrics = metrics
        self._requests: dict[str, RequestHandle] = {}  # active (unfinished or unacknowledged)
        # Called with each request entering the table, new or resumed (features' `admit`).
        self.admit: tuple[Callable[[RequestHandle], None], ...] = ()

    @property
    def handles(self) -> Mapping[str, RequestHandle]:
        """By id, read-only (the step's hot path reads it directly)."""
        return self._requests

    def get(self, req_id: str) -> RequestHandle | None:
        return self._requests.get(req_id)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[RequestHandle]:
        """A snapshot: callers may finish (and so later drop) requests while iterating."""
        return iter(list(self._requests.values()))

    def on_executor(self, ex: ExecutorHandle) -> list[RequestHandle]:
        return [h for h in self._requests.values() if h.executor is ex]

    def add(self, handle: RequestHandle) -> None:
        for admit in self.admit:  # the features' choice of how its results are applied
            admit(handle)
        self._requests[handle.req_id] = handle

    def started(self, new_seqs: Iterable[NewSeqData], now: float) -> None:
        """Sequences sent in full: first scheduled, or again after a preemption. A request's
        first one ends its queueing (metrics, the key's queued tokens)."""
        for s in new_seqs:
            handle = self._requests.get(req_id_of(s.seq_id))
            if handle is not None and handle.scheduled_time is None:
                handle.scheduled_time = now
                self.usage.started(handle)

    def finish(self, handle: RequestHandle, record: EngineStep) -> None:
        """Record `handle`'s finish in `record` (its sequences are final)."""
        handle.finished_in_engine = True
        self.usage.finished(handle)
        now = time.time()
        self.metrics.on_finish(handle, now)
        if handle.trace_span is not None:
            tracing.request_finished(handle, now)
        record.finishes.append(handle.finish_record())
        # Forget it only once Redis has it: until then it must stay resumable from memory.
        record.after.append(lambda: self._requests.pop(handle.req_id, None))
        log.info("request.finished", req_id=handle.req_id, reasons=handle.finish_reasons())

    def fail(self, handle: RequestHandle, record: EngineStep, error: str) -> None:
        """End every sequence of `handle` with an error finish that tells the client why."""
        for i in range(handle.n):
            handle.finish_seq(i, RequestStatus.FINISHED_ERROR, None, record, error)
        self.finish(handle, record)

    def finish_ended_in_core(self, ex: ExecutorHandle, record: EngineStep) -> None:
        """Record the requests `ex`'s scheduler core ended since the last look: by a stop check,
        or on its own (one that can never fit the cache ends with an error)."""
        for req in ex.sched.take_finished_requests():
            handle = self._requests.get(req.req_id)
            if handle is None or handle.finished_in_engine or handle.executor is not ex:
                continue  # gone, already final, or moved to another executor
            for seq in req.seqs:
                if not handle.seq_finished(seq.index):
                    handle.finish_seq(seq.index, seq.status, seq.stop_reason, record, req.error)
            self.finish(handle, record)

    def close_all(self, reason: str) -> None:
        for handle in self._requests.values():
            handle.close(reason)
