"""One executor as the scheduler sees it: its connection, its scheduler core, its state, and
the steps it is sent (`send`) and returns (`step_done`, which keeps its timing)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos import executor_pb2 as epb
from protos import executor_pb2_grpc as epb_grpc
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.engine.fleet.step_message import execute_request

__all__ = ["ExecutorHandle", "ExecutorState", "Sent"]


class ExecutorState(enum.Enum):
    """Where an executor stands, as far as this scheduler knows; only its handle changes it."""

    UP = "up"  # reachable, takes new requests
    DRAINING = "draining"  # reachable, shutting down: finishes what it runs, gets nothing new
    DOWN = (
        "down"  # failed a step or a probe: reconnecting; its requests move after the fail-over time
    )
    DOWN_DRAINING = "down_draining"  # down after it said it drains: not coming back, move at once
    RETIRED = "retired"  # left the registry for good and dropped by the pool: its loop ends


# Describe's role (prefill/decode disaggregation) by name; UNSPECIFIED (an older build): both.
ROLE_NAMES = {
    epb.EXECUTOR_ROLE_PREFILL: "prefill",
    epb.EXECUTOR_ROLE_DECODE: "decode",
    epb.EXECUTOR_ROLE_BOTH: "both",
}

_UP = (ExecutorState.UP, ExecutorState.DRAINING)
_DRAINING = (ExecutorState.DRAINING, ExecutorState.DOWN_DRAINING)


@dataclass(slots=True)
class Sent:
    """A step on its way to an executor."""

    out: SchedulerOutput
    step_id: int  # ExecuteModelRequest.step_id
    call: grpc.aio.UnaryUnaryCall
    sent_at: float  # time.perf_counter()
    trace_span: Any = None  # a sampled step's span (scheduler_svc/tracing.py); None: not traced


@dataclass(slots=True)
class ExecutorHandle:
    address: str
    channel: grpc.aio.Channel
    stub: epb_grpc.ExecutorStub
    describe: epb.DescribeResponse
    sched: Scheduler
    state: ExecutorState = ExecutorState.UP
    step_id: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    consecutive_failures: int = 0
    down_since: float = 0.0  # time.monotonic() of the failure that took it down
    # Its loop is parked with nothing to schedule (the health monitor probes only these). The
    # loop's own note, not the executor's state: only the step loop writes it.
    idle: bool = False
    # Steps that raised inside the scheduler since the last one that completed.
    num_crashed_steps: int = 0
    # For metrics: steps sent, seconds the executor was busy with them, wall time the last
    # one ended (time.time(), and time.perf_counter() for the busy time).
    num_steps: int = 0
    num_steps_ahead: int = 0  # of those, planned while the one before was running
    step_seconds: float = 0.0
    last_step_time: float = 0.0
    last_step_done: float = 0.0
    # Tasks waiting in exclusive(): the engine loop plans no step ahead while there are any.
    num_lock_waiters: int = 0
    # Prompt tokens (prefill chunks, recomputes) sent to it since it was connected.
    num_prefill_tokens: int = 0

    @property
    def healthy(self) -> bool:
        return self.state in _UP

    @property
    def draining(self) -> bool:
        return self.state in _DRAINING

    @property
    def takes_work(self) -> bool:
        """Up and not draining: new requests, moved ones and handoffs may go to it."""
        return self.healthy and not self.draining

    @property
    def role(self) -> str:
        """What it said it is for (`--role`): "both", "prefill" or "decode"."""
        return ROLE_NAMES.get(self.describe.role, "both")

    @property
    def prefills(self) -> bool:
        """New prompts go to it (while one like it is up)."""
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        """Requests are handed over to it after their prefill."""
        return self.role != "prefill"

    @property
    def retired(self) -> bool:
        return self.state is ExecutorState.RETIRED

    def set_draining(self, draining: bool) -> None:
        """What the executor said (Describe, a step reply); up or down stays as it is."""
        if self.healthy:
            self.state = ExecutorState.DRAINING if draining else ExecutorState.UP
        elif not self.retired:
            self.state = ExecutorState.DOWN_DRAINING if draining else ExecutorState.DOWN

    def went_down(self) -> None:
        if self.healthy:
            self.down_since = time.monotonic()
        if not self.retired:
            self.state = ExecutorState.DOWN_DRAINING if self.draining else ExecutorState.DOWN

    def came_back(self) -> None:
        self.state = ExecutorState.DRAINING if self.draining else ExecutorState.UP

    def send(
        self,
        out: SchedulerOutput,
        after_step_id: int,
        epoch: int,
        timeout_s: float,
        add_masks: Callable[[epb.ExecuteModelRequest, SchedulerOutput], None] | None = None,
        metadata: Any = None,
        trace_span: Any = None,
    ) -> Sent:
        """Start the step `out` on the executor (right after step `after_step_id` when it was
        planned ahead; 0: none). `add_masks` adds the constrained sequences' token masks."""
        self.step_id += 1
        for seq, n in out.scheduled:
            self.num_prefill_tokens += max(
                0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            )
        msg = execute_request(out, self.step_id)
        if add_masks is not None:
            add_masks(msg, out)
        msg.instance_id = self.describe.instance_id
        msg.leader_epoch = epoch
        msg.after_step_id = after_step_id
        call = self.stub.ExecuteModel(msg, timeout=timeout_s, metadata=metadata)
        return Sent(out, self.step_id, call, time.perf_counter(), trace_span)

    def step_done(self, sent: Sent) -> tuple[float, float | None]:
        """Count a step that came back: its busy time, from when the executor could start it
        (its sending, or the end of the step it followed). Returns the wall time now and the
        interval since the previous step came back (None for the first)."""
        done = time.perf_counter()
        self.step_seconds += done - max(sent.sent_at, self.last_step_done)
        self.last_step_done = done
        self.num_steps += 1
        self.consecutive_failures = 0
        now = time.time()
        last, self.last_step_time = self.last_step_time, now
        return now, (now - last if last else None)

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold `lock` from outside the engine loop (an abort, a recovery): between two steps,
        never in the middle of one. The loop plans no step ahead while someone waits here, so
        a run of decode steps planned ahead ends at the next step."""
        self.num_lock_waiters += 1
        try:
            await self.lock.acquire()
        finally:
            self.num_lock_waiters -= 1
        try:
            yield
        finally:
            self.lock.release()
