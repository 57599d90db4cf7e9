"""What the engine does when a step or an executor fails: a scheduler bug inside a step, a
step the executor refused or never answered, an executor draining, lost or coming back.
Functions of the engine, as `requests` and `recovery` are; the engine loop calls them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import structlog

from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.engine import recovery
from scheduler_svc.engine.streams import EngineStep

if TYPE_CHECKING:
    from scheduler_svc.engine.engine import Engine
    from scheduler_svc.engine.executors import ExecutorHandle

log = structlog.get_logger(__name__)

__all__ = ["draining", "executor_lost", "reconnect", "step_crashed", "step_failed"]


def step_crashed(
    engine: Engine,
    ex: ExecutorHandle,
    out: SchedulerOutput | None,
    record: EngineStep,
    error: Exception,
) -> None:
    """A step raised inside the scheduler (a bug): log it once, keep serving.

    The requests of the step end with an error finish: what the step did to their state is
    unknown, and one of them may be what triggers the bug. What the step had already
    recorded is still written, so clients and Redis agree on every token. Every other
    request of the executor is recomputed on a fresh scheduler core, whose state is known.
    A step that cannot even be planned fails nobody, unless it fails three times in a row.
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
    for handle in list(engine.requests.values()):
        if handle.executor is not ex or handle.finished_in_engine:
            continue
        if give_up or handle.req_id in in_step:
            engine.fail_request(
                handle, record, "internal error in the scheduler while running this request"
            )
    engine.persister.submit(record.to_record())
    recovery.rebuild_core(engine, ex)


def step_failed(engine: Engine, ex: ExecutorHandle, e: grpc.aio.AioRpcError) -> None:
    if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "leadership epoch" in (
        e.details() or ""
    ):
        engine.leadership_lost(f"executor {ex.address} refused the step: {e.details()}")
        return
    ex.consecutive_failures += 1
    log.error("executor.step_failed", address=ex.address, code=e.code().name, details=e.details())
    engine.pool.mark_failed(ex)
    engine.health.update()


def draining(engine: Engine, ex: ExecutorHandle) -> None:
    """`ex` said it is shutting down gracefully: nothing new for it, and what it has not
    started (also a request it preempts) goes elsewhere."""
    if not ex.draining:
        log.info("executor.draining", address=ex.address, running=ex.sched.num_running)
        ex.draining = True
    if ex.sched.num_waiting:
        recovery.move_waiting(engine, ex)


async def executor_lost(engine: Engine, ex: ExecutorHandle, reason: str) -> None:
    """`ex` stopped answering or restarted while idle: reconnect it (and recompute)."""
    async with ex.exclusive():
        if not ex.healthy:
            return
        log.warning("executor.lost", address=ex.address, reason=reason)
        engine.pool.mark_failed(ex)
    engine.health.update()


async def reconnect(engine: Engine, ex: ExecutorHandle) -> None:
    """One attempt to bring `ex` back; past the fail-over time, its requests move."""
    reshaped = await engine.pool.reconnect(ex)
    if reshaped is None:  # still unreachable
        if engine.pool.failover_due(ex):
            recovery.fail_over(engine, ex)
        return
    if reshaped:
        # Back with another cache shape: the old core's block ids may not even exist
        # there. A fresh core sized for it; the requests are recomputed.
        async with ex.lock:
            recovery.rebuild_core(engine, ex)
    ex.healthy = True
    engine.health.update()
    ex.wake.set()
    if ex.consecutive_failures >= 3:
        # The same step keeps failing: fail what is running rather than loop forever.
        record = EngineStep()
        for req_id in list(ex.sched.running_request_ids()):
            handle = engine.requests.get(req_id)
            if handle is not None and not handle.finished_in_engine:
                ex.sched.abort_request(req_id)
                engine.fail_request(handle, record, "executor rejected the request repeatedly")
        engine.persister.submit(record.to_record())
        ex.consecutive_failures = 0
