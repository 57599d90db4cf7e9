"""What the engine does when a step or an executor fails: a scheduler bug inside a step, a
step the executor refused or never answered, an executor draining, or coming back.

Handed what it acts on (the request table, the pool, the persister, recovery and the
lifecycle); the step loop calls it.
"""

from __future__ import annotations

import grpc
import structlog

from protos import executor_pb2 as epb
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.engine.faults.lifecycle import Lifecycle
from scheduler_svc.engine.faults.migration import Migration
from scheduler_svc.engine.faults.recovery import Recovery
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.fleet.executors import ExecutorPool
from scheduler_svc.engine.request_table import RequestTable
from scheduler_svc.engine.streams import EngineStep
from scheduler_svc.state.persister import Persister

log = structlog.get_logger(__name__)

__all__ = ["Faults"]


class Faults:
    def __init__(
        self,
        table: RequestTable,
        pool: ExecutorPool,
        persister: Persister,
        recovery: Recovery,
        lifecycle: Lifecycle,
        migration: Migration | None = None,
    ) -> None:
        self.table = table
        self.pool = pool
        self.persister = persister
        self.recovery = recovery
        self.lifecycle = lifecycle
        # Live migration on drain (None: --no-migrate-on-drain).
        self.migration = migration

    async def step_crashed(
        self,
        ex: ExecutorHandle,
        out: SchedulerOutput | None,
        record: EngineStep,
        error: Exception,
    ) -> None:
        """A step raised inside the scheduler (a bug): log it once, keep serving.

        The requests of the step end with an error finish: what the step did to their state
        is unknown, and one of them may be what triggers the bug. What the step had already
        recorded is still written, so clients and Redis agree on every token. Every other
        request of the executor is recomputed on a fresh scheduler core, whose state is known.
        A step that cannot even be planned (`out` None) fails nobody, unless it fails three
        times in a row. The executor is Reset: its state has to match the fresh core's.
        """
        ex.num_crashed_steps += 1
        log.error(
            "engine.step_crashed",
            address=ex.address,
            error=repr(error),
            num_crashed_steps=ex.num_crashed_steps,
            exc_info=error,
        )
        give_up = out is None and ex.num_crashed_steps >= 3
        in_step = {seq.req_id for seq, _ in out.scheduled} if out is not None else set()
        for handle in self.table.on_executor(ex):
            if handle.finished_in_engine:
                continue
            if give_up or handle.req_id in in_step:
                error_text = "internal error in the scheduler while running this request"
                self.table.fail(handle, record, error_text)
        self.persister.submit(record)
        self.recovery.rebuild_core(ex)
        try:
            await ex.stub.Reset(epb.ResetRequest(leader_epoch=self.pool.epoch), timeout=5)
        except grpc.aio.AioRpcError as reset_error:
            self.step_failed(ex, reset_error)

    def step_failed(self, ex: ExecutorHandle, e: grpc.aio.AioRpcError) -> None:
        """The executor refused a step or never answered it."""
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "leadership epoch" in (
            e.details() or ""
        ):
            self.lifecycle.lose_leadership(f"executor {ex.address} refused the step: {e.details()}")
            return
        ex.consecutive_failures += 1
        log.error(
            "executor.step_failed", address=ex.address, code=e.code().name, details=e.details()
        )
        self.pool.mark_failed(ex)

    def draining(self, ex: ExecutorHandle) -> None:
        """`ex` said it is shutting down gracefully: nothing new for it, what it has not
        started (also a request it preempts) goes elsewhere, and what it runs moves with its
        KV cache (live migration, unless turned off; in the background, between its steps)."""
        if not ex.draining:
            log.info(
                "executor.draining",
                address=ex.address,
                running=ex.sched.num_running,
                waiting=ex.sched.num_waiting,
            )
            ex.set_draining(True)
        if ex.sched.num_waiting:
            self.recovery.move_waiting(ex)
        if self.migration is not None and ex.sched.num_running:
            self.migration.start(ex)

    async def reconnect(self, ex: ExecutorHandle) -> None:
        """One attempt to bring `ex` back; past the fail-over time, its requests move."""
        reshaped = await self.pool.reconnect(ex)
        if reshaped is None:  # still unreachable
            if self.pool.failover_due(ex):
                self.recovery.fail_over(ex)
            return
        if reshaped:
            # Back with another cache shape: the old core's block ids may not even exist
            # there. A fresh core sized for it; the requests are recomputed.
            async with ex.lock:
                self.recovery.rebuild_core(ex)
        self.pool.mark_up(ex)
        if ex.consecutive_failures >= 3:
            self._fail_running(ex)

    def _fail_running(self, ex: ExecutorHandle) -> None:
        """The same step keeps failing: fail what is running rather than loop forever."""
        record = EngineStep()
        for req_id in list(ex.sched.running_request_ids()):
            handle = self.table.get(req_id)
            if handle is not None and not handle.finished_in_engine:
                ex.sched.abort_request(req_id)
                self.table.fail(handle, record, "executor rejected the request repeatedly")
        self.persister.submit(record)
        ex.consecutive_failures = 0
