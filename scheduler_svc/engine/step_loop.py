"""Each executor's loop: schedule -> ExecuteModel -> apply the reply -> hand it to the persister.

The step function is chosen once, from the configuration: a plain step (one step at a time) or,
with async scheduling, a step that plans and sends the next decode step while the executor
still runs the current one (core/ahead.py), so that the executor never waits for us between
decode steps. The loop only calls it. What the scheduler core ended is collected once per step:
after the reply was applied (or at once, when there was nothing to send).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from protos import executor_pb2 as epb
from scheduler_svc import failpoints, tracing
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.engine.faults.faults import Faults
from scheduler_svc.engine.faults.lifecycle import Lifecycle
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle, Sent
from scheduler_svc.engine.fleet.executors import ExecutorPool
from scheduler_svc.engine.handoff import Handoff
from scheduler_svc.engine.metrics import EngineMetrics
from scheduler_svc.engine.request_table import RequestTable
from scheduler_svc.engine.step_results import process_step_outputs
from scheduler_svc.engine.streams import EngineStep
from scheduler_svc.features.base import NO_FEATURES, Features
from scheduler_svc.state.persister import Persister

__all__ = ["StepLoop"]


@dataclass(slots=True)
class _Run:
    """One step, or a run of steps planned ahead, on one executor."""

    in_flight: list[Sent] = field(default_factory=list)  # oldest first; at most two
    # The step whose reply is awaited or being applied; None while planning (a crash then is
    # the plan's, not a running step's).
    out: SchedulerOutput | None = None
    record: EngineStep = field(default_factory=EngineStep)  # what the step applying produced

    def cancel(self) -> None:
        for sent in self.in_flight:  # after a failure: their results are not wanted any more
            sent.call.cancel()


class StepLoop:
    def __init__(
        self,
        config: EngineConfig,
        lifecycle: Lifecycle,
        pool: ExecutorPool,
        table: RequestTable,
        persister: Persister,
        faults: Faults,
        metrics: EngineMetrics,
        features: Features = NO_FEATURES,
        handoff: Handoff | None = None,
    ) -> None:
        self.step_timeout_s = config.step_timeout_s
        self.lifecycle = lifecycle
        self.pool = pool
        self.table = table
        self.persister = persister
        self.faults = faults
        self.metrics = metrics
        # The optional features' hooks (scheduler_svc/features): what they add to each step's
        # message, and what they take from its reply.
        self.features = features
        # Prefill/decode disaggregation: a prefill executor's requests move on after prefill.
        self.handoff = handoff
        # Chosen once: True from a step means there was nothing to do.
        self.step: Callable[[ExecutorHandle], Awaitable[bool]] = (
            self._step_ahead if config.async_scheduling else self._step_plain
        )

    async def run(self, ex: ExecutorHandle) -> None:
        """Step `ex` until the engine stops or the executor is retired."""
        while not self.lifecycle.stopping and not ex.retired:
            if not ex.healthy:
                self.persister.kick()
                await self.faults.reconnect(ex)
                continue
            if self.persister.over_backlog:
                await self.persister.wait_below_backlog()
                continue
            ex.wake.clear()
            async with ex.lock:
                for hook in self.features.between_steps:  # e.g. requests past their deadline
                    hook(ex)
                idle = await self.step(ex)
            if self.handoff is not None and self.handoff.hands_off(ex):
                await self.handoff.run(ex)
            if idle:
                self.persister.kick()
                ex.idle = True
                await ex.wake.wait()
                ex.idle = False
            # Busy: RPC handlers (new requests, aborts) run while the next step is awaited.
        if ex.retired:
            await ex.channel.close()

    async def _step_plain(self, ex: ExecutorHandle) -> bool:
        """Schedule, execute, apply (the executor's lock held)."""
        run = _Run()
        try:
            out = self._schedule(ex)
            if out is None:
                return True
            run.in_flight.append(self._send(ex, out, 0))
            await self._complete_oldest(ex, run)
        except Exception as e:
            await self.faults.step_crashed(ex, run.out, run.record, e)
        finally:
            run.cancel()
        return False

    async def _step_ahead(self, ex: ExecutorHandle) -> bool:
        """As `_step_plain`, but while a decode step runs the one after it is planned and sent
        (schedule_ahead), for as long as the next step is certain."""
        run = _Run()
        try:
            out = self._schedule(ex)
            if out is None:
                return True
            run.in_flight.append(self._send(ex, out, 0))
            while run.in_flight:
                if len(run.in_flight) == 1 and self._may_plan_ahead(ex):
                    self._plan_ahead(ex, run)
                if not await self._complete_oldest(ex, run):
                    break
        except Exception as e:
            await self.faults.step_crashed(ex, run.out, run.record, e)
        finally:
            run.cancel()
        return False

    def _schedule(self, ex: ExecutorHandle) -> SchedulerOutput | None:
        """The next step, or None when it holds nothing for the executor (then what the core
        ended meanwhile, e.g. a request that can never fit, is recorded at once)."""
        if failpoints.ARMED:
            failpoints.hit("engine.schedule")
        out = ex.sched.schedule()
        if not out.is_empty:
            return out
        self._record_ended_in_core(ex)
        return None

    def _plan_ahead(self, ex: ExecutorHandle, run: _Run) -> None:
        run.out = None
        if failpoints.ARMED:
            failpoints.hit("engine.schedule")
        ahead = ex.sched.schedule_ahead()
        if ahead is not None:
            run.in_flight.append(self._send(ex, ahead, run.in_flight[0].step_id))
            ex.num_steps_ahead += 1

    def _may_plan_ahead(self, ex: ExecutorHandle) -> bool:
        """Whether the next step may be sent before this one is back: not when the step's
        outcome must be seen first (stopping, draining, a write backlog, a feature's
        ``holds_ahead``: a deadline due), nor when an abort or a recovery waits for the
        executor's lock (they get in between two steps)."""
        return (
            not self.lifecycle.stopping
            and ex.healthy
            and not ex.draining
            and ex.num_lock_waiters == 0
            and not (self.handoff is not None and self.handoff.hands_off(ex))
            and not self.persister.over_backlog
            and not any(holds(ex) for holds in self.features.holds_ahead)
        )

    def _send(self, ex: ExecutorHandle, out: SchedulerOutput, after_step_id: int) -> Sent:
        add = self.features.step_message
        if tracing.ENABLED:  # a sampled step carries its trace context to the executor
            md, span = tracing.step_start(out, self.table.handles)
            return ex.send(out, after_step_id, self.pool.epoch, self.step_timeout_s, add, md, span)
        return ex.send(out, after_step_id, self.pool.epoch, self.step_timeout_s, add)

    async def _complete_oldest(self, ex: ExecutorHandle, run: _Run) -> bool:
        """Wait for the oldest step in flight and apply its reply; False when the executor
        failed it (the executor is then marked failed)."""
        sent = run.in_flight[0]
        run.out = sent.out
        # The previous step's Redis write goes out now, while the executor computes (its
        # record was queued without waking the writer).
        self.persister.kick()
        try:
            resp = await sent.call
        except grpc.aio.AioRpcError as e:
            self.persister.kick()
            self.faults.step_failed(ex, e)
            self._record_ended_in_core(ex)
            return False
        del run.in_flight[0]
        now, interval = ex.step_done(sent)
        if failpoints.ARMED:
            failpoints.hit("engine.process_step")
        self._apply(ex, sent.out, resp, run.record, now, interval)
        if sent.trace_span is not None:
            tracing.step_done(sent.trace_span, run.record)
        run.record = EngineStep()
        ex.num_crashed_steps = 0
        if resp.draining:
            self.faults.draining(ex)
        return True

    def _apply(
        self,
        ex: ExecutorHandle,
        out: SchedulerOutput,
        resp: epb.ExecuteModelResponse,
        record: EngineStep,
        now: float,
        interval: float | None,
    ) -> None:
        process_step_outputs(ex.sched, self.table.handles, out, resp, record, self.features)
        for hook in self.features.after_reply:
            hook(ex, resp)
        self.table.started(out.new_seqs, now)
        num_sampled = len(resp.sampled) + len(resp.decode_token_ids)
        self.metrics.on_step(
            now, interval, out.total_num_scheduled_tokens, num_sampled, record.first_tokens
        )
        self.table.finish_ended_in_core(ex, record)
        # Written once the next step is on its way (see _complete_oldest), or when the loop
        # goes idle.
        self.persister.submit(record, wake=False)

    def _record_ended_in_core(self, ex: ExecutorHandle) -> None:
        record = EngineStep()
        self.table.finish_ended_in_core(ex, record)
        self.persister.submit(record)
