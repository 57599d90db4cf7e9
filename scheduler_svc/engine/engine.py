"""The engine: one asyncio loop per executor, schedule -> ExecuteModel -> outputs -> persist.

Each executor has its own scheduler core (queues and block tables for its KV cache). A step's
output is handed to the persister and the loop moves on: clients see tokens only once Redis
has acknowledged them, but the next step never waits for Redis unless the write backlog passes
its bound. Around the loop, in their own modules: the request API the servicer calls
(`requests`), recompute after any loss (`recovery`), the executors and their faults
(`executors`), per-request stream state (`streams`), what a reply does (`step_results`) and
health (`health`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import grpc
import structlog

from protos import executor_pb2 as epb
from scheduler_svc import failpoints
from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.engine import aborts, faults, recovery, requests
from scheduler_svc.engine.config import AbortOutcome, EngineConfig, GenerateInput, ServerInfo
from scheduler_svc.engine.embeds import EmbedRequests
from scheduler_svc.engine.executors import ExecutorHandle, ExecutorPool
from scheduler_svc.engine.health import HealthMonitor
from scheduler_svc.engine.key_usage import KeyUsage
from scheduler_svc.engine.metrics import EngineMetrics
from scheduler_svc.engine.routing import Router
from scheduler_svc.engine.step_message import execute_request
from scheduler_svc.engine.step_results import process_step_outputs
from scheduler_svc.engine.streams import EngineStep, RequestHandle, RequestView
from scheduler_svc.grammar.structured import StructuredOutputs
from scheduler_svc.output.detokenizer import token_byte_table
from scheduler_svc.output.tokenizer import load_tokenizer
from scheduler_svc.state.leader import LeaderLease
from scheduler_svc.state.persister import Persister
from scheduler_svc.state.store import RequestStore

log = structlog.get_logger(__name__)

__all__ = ["Engine"]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.store = RequestStore(config.redis_url, finished_ttl_s=config.finished_ttl_s)
        self.persister = Persister(
            self.store,
            max_backlog_steps=config.max_backlog_steps,
            resync=lambda: recovery.resync_store(self),
        )
        self.pool = ExecutorPool(config, self.store)
        self.executors = self.pool.executors  # the same list
        self.requests: dict[str, RequestHandle] = {}  # active (unfinished or unacknowledged)
        self.creating = aborts.CreatingIds()  # ids a Generate is claiming in Redis right now
        self.tokenizer = None
        self.ready = False
        # Leader election: waiting for the lease (standby), and why leadership was lost; once
        # lost this engine writes nothing more and the process starts over as a standby.
        self.standby = config.leader_election
        self.lost_leadership: str | None = None
        self.leadership_lost_event = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self.health = HealthMonitor(self, lambda serving: None, interval_s=config.health_interval_s)
        self.eos_token_ids: list[int] = []
        self.max_model_len = 0
        self.vocab_size = 0
        self.block_size = 0
        self.metrics = EngineMetrics(self)
        self.router = Router(config.routing, config.routing_prefill_weight)
        self.usage = KeyUsage(config.max_requests_per_key, config.max_queued_tokens_per_key)
        self.embeds = EmbedRequests(self)  # Embed calls in flight (engine/embeds.py)
        self.structured = StructuredOutputs(self.requests)  # grammar masks (scheduler_svc/grammar)
        self.persister.on_write = self.metrics.redis_write.observe

    # ---------------------------------------------------------------- lifecycle

    async def start(self, on_ready_change: Callable[[bool], None] | None = None) -> None:
        if on_ready_change is not None:
            self.health.on_change = on_ready_change
        self.health.update()
        self.persister.on_fenced = self.leadership_lost
        self.persister.start()
        if self.config.leader_election:
            self._spawn(self._lead(), "engine.lead")
        else:
            self._spawn(self._connect_all(), "engine.connect")
        self._spawn(self.health.run(), "engine.health")

    async def _lead(self) -> None:
        """Stand by until this scheduler holds the leader lease, then start serving (connect,
        recover) with its epoch on every write; hold the lease until it is lost."""
        lease = LeaderLease(self.config.redis_url, ttl_s=self.config.lease_ttl_s)
        tasks: list[asyncio.Task] = []
        try:
            epoch = await lease.acquire()
            self.store.epoch = self.pool.epoch = epoch
            self.standby = False
            self.health.update()
            holding = asyncio.create_task(lease.hold(), name="engine.lease")
            tasks = [holding, asyncio.create_task(self._connect_all(), name="engine.connect")]
            reason = await holding  # _connect_all runs beside it
            self.leadership_lost(reason)
        finally:
            for task in tasks:
                task.cancel()
            if self._stopping and self.lost_leadership is None:
                await lease.release()  # a clean stop hands over at once
            await lease.close()

    def leadership_lost(self, reason: str) -> None:
        """Another scheduler leads now (lease lost, or a write or step was fenced): stop
        everything at once. Nothing more can be written (Redis and executors refuse this
        epoch); the caller starts the process over as a standby."""
        if self.lost_leadership is not None:
            return
        self.lost_leadership = reason
        log.error("leader.lost", reason=reason, epoch=self.store.epoch)
        self._stopping = True
        self.ready = False
        self.health.update()
        for ex in self.executors:
            ex.wake.set()
        self.leadership_lost_event.set()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _spawn(self, coro: Coroutine[object, object, None], name: str) -> None:
        """Run one of the engine's own tasks; one that dies of an error says so in the log."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_task_failure)
        self._tasks.append(task)

    async def _connect_all(self) -> None:
        for address in await self.pool.initial_addresses():
            handle = await self.pool.connect(address)
            assert handle is not None  # connect() keeps trying
            self.executors.append(handle)
            if self.tokenizer is None:
                reply = await handle.stub.GetTokenizer(epb.GetTokenizerRequest())
                files = {f.name: f.content for f in reply.files}
                self.tokenizer = await asyncio.to_thread(
                    load_tokenizer, files, reply.tokenizer_class
                )
                # Built here, off the loop, rather than by the first request's detokenizer.
                await asyncio.to_thread(token_byte_table, self.tokenizer)
                if failpoints.ARMED:  # tests widen the window before the limits are known
                    await asyncio.sleep(failpoints.delay("engine.start"))
        first = self.executors[0].describe
        self.eos_token_ids = list(first.eos_token_ids)
        self.vocab_size = first.vocab_size
        self.structured.start(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.block_size = first.block_size
        self.max_model_len = min(
            first.max_model_len, self.config.max_model_len or first.max_model_len
        )
        await recovery.recover(self)
        # Start-up built long-lived objects (tokenizer, tables, recovered requests): move them out
        # of the collector's way so the steps' young-object collections do not rescan them.
        gc.collect()
        gc.freeze()
        for ex in self.executors:
            self._spawn(self._loop(ex), f"engine.{ex.address}")
        if self.config.discover_executors:
            self._spawn(self._discover(), "engine.discover")
        self.ready = True
        self.health.update()
        log.info("engine.ready", executors=len(self.executors), recovered=len(self.requests))

    async def _discover(self) -> None:
        """Serve executors that register in Redis after start-up (scaling out at run time)."""
        while not self._stopping:
            await asyncio.sleep(self.config.discovery_interval_s)
            for ex in await self.pool.discover():
                self._spawn(self._loop(ex), f"engine.{ex.address}")
            retired = self.pool.retire_gone()
            for ex in retired:
                self.router.forget(ex)
            if retired:
                self.health.update()

    async def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop taking requests, let running ones finish for up to `drain_timeout_s`, then stop.

        Requests still unfinished stay in Redis as they are and resume on the next start.
        """
        self._stopping = True
        self.ready = False
        self.health.update()
        deadline = time.monotonic() + drain_timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down
                await task
        try:
            await asyncio.wait_for(self.persister.wait_drained(), timeout=drain_timeout_s)
        except TimeoutError:
            log.warning("engine.stop.unflushed", backlog=self.persister.backlog)
        await self.persister.stop()
        for handle in self.requests.values():
            handle.close("scheduler shutting down; resume the request by id")
        for ex in self.executors:
            await ex.channel.close()
        await self.store.close()
        log.info("engine.stopped", unfinished=len(self.requests))

    # ---------------------------------------------------------------- requests (requests.py, aborts.py)

    async def submit(self, inp: GenerateInput) -> tuple[RequestHandle, bool]:
        """The request's stream state, and whether this call created it (False: attached to
        an existing request with the same id)."""
        return await requests.submit(self, inp)

    async def attach(self, req_id: str) -> RequestHandle:
        return await requests.attach(self, req_id)

    async def abort(self, req_id: str, *, missing_ok: bool = False) -> AbortOutcome:
        """Returns once the outcome is final and in Redis (see engine/aborts.py)."""
        return await aborts.abort(self, req_id, missing_ok=missing_ok)

    async def get_request(self, req_id: str) -> RequestView:
        return await requests.get_request(self, req_id)

    def server_info(self) -> ServerInfo:
        return requests.server_info(self)

    async def tokenize(self, inp: GenerateInput) -> list[int]:
        return await requests.tokenize(self, inp)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> tuple[str, list[str]]:
        return requests.detokenize(self, token_ids, skip_special_tokens)

    # ---------------------------------------------------------------- the loop

    async def _loop(self, ex: ExecutorHandle) -> None:
        while not self._stopping and not ex.retired:
            if not ex.healthy:
                self.persister.kick()
                await faults.reconnect(self, ex)
                continue
            if self.persister.over_backlog:
                await self.persister.wait_below_backlog()
                continue
            ex.wake.clear()
            async with ex.lock:
                idle = await self._step(ex)
            if idle:
                self.persister.kick()
                ex.idle = True
                await ex.wake.wait()
                ex.idle = False
            # Busy: RPC handlers (new requests, aborts) run while the next step is awaited.
        if ex.retired:
            await ex.channel.close()

    async def _step(self, ex: ExecutorHandle) -> bool:
        """One engine step on `ex` (its lock held), or with async scheduling a run of them:
        while a decode step runs, the one after it is planned and sent (schedule_ahead), so the
        executor goes from one to the next without waiting for us. True when there was
        nothing to do."""
        out = None
        record = EngineStep()
        in_flight: list[_Sent] = []
        try:
            if failpoints.ARMED:
                failpoints.hit("engine.schedule")
            out = ex.sched.schedule()
            self._handle_scheduler_finished(ex)
            if out.is_empty:
                return True
            in_flight.append(self._send(ex, out, 0))
            while in_flight:
                sent = in_flight[0]
                out = None  # planning: a crash here is the plan's, not the running step's
                if len(in_flight) == 1 and self._may_plan_ahead(ex):
                    if failpoints.ARMED:
                        failpoints.hit("engine.schedule")
                    ahead = ex.sched.schedule_ahead()
                    if ahead is not None:
                        in_flight.append(self._send(ex, ahead, sent.step_id))
                        ex.num_steps_ahead += 1
                out = sent.out
                # The previous step's Redis write goes out now, while the executor computes
                # (its record was queued without waking the writer).
                self.persister.kick()
                try:
                    resp = await sent.call
                except grpc.aio.AioRpcError as e:
                    self.persister.kick()
                    faults.step_failed(self, ex, e)
                    return False
                del in_flight[0]
                done = time.perf_counter()
                # Busy from when the executor could start it: its sending, or the end of the
                # step it followed.
                ex.step_seconds += done - max(sent.sent_at, ex.last_step_done)
                ex.last_step_done = done
                ex.num_steps += 1
                ex.consecutive_failures = 0
                if failpoints.ARMED:
                    failpoints.hit("engine.process_step")
                self._process_step(ex, out, resp, record)
                record = EngineStep()
                ex.num_crashed_steps = 0
                if resp.draining:
                    faults.draining(self, ex)
        except Exception as e:
            faults.step_crashed(self, ex, out, record, e)
            try:
                await ex.stub.Reset(epb.ResetRequest(leader_epoch=self.pool.epoch), timeout=5)
            except grpc.aio.AioRpcError as reset_error:
                faults.step_failed(self, ex, reset_error)
        finally:
            for sent in in_flight:  # after a failure: its results are not wanted any more
                sent.call.cancel()
        return False

    def _send(self, ex: ExecutorHandle, out: SchedulerOutput, after_step_id: int) -> _Sent:
        """Send the step `out` to `ex` (after step `after_step_id` when planned ahead)."""
        ex.step_id += 1
        msg = execute_request(out, ex.step_id)
        self.structured.add_masks(msg, out)
        msg.instance_id = ex.describe.instance_id
        msg.leader_epoch = self.pool.epoch
        msg.after_step_id = after_step_id
        call = ex.stub.ExecuteModel(msg, timeout=self.config.step_timeout_s)
        return _Sent(out, ex.step_id, call, time.perf_counter())

    def _may_plan_ahead(self, ex: ExecutorHandle) -> bool:
        """Whether the next step may be sent before this one is back: not when the step's
        outcome must be seen first (stopping, draining, a write backlog), nor when an abort or
        a recovery waits for the executor's lock (they get in between two steps)."""
        return (
            self.config.async_scheduling
            and not self._stopping
            and ex.healthy
            and not ex.draining
            and not ex.retired
            and ex.num_lock_waiters == 0
            and not self.persister.over_backlog
        )

    def _process_step(
        self,
        ex: ExecutorHandle,
        out: SchedulerOutput,
        resp: epb.ExecuteModelResponse,
        record: EngineStep,
    ) -> None:
        done = process_step_outputs(
            ex.sched, self.requests, out, resp, record, self.structured.grammar_done
        )
        if resp.pooled:  # embedding inputs whose prompt completed (engine/embeds.py)
            self.embeds.on_pooled(ex, list(resp.pooled))
        now = time.time()
        for s in out.new_seqs:  # sent in full: first scheduled, or again after a preemption
            handle = self.requests.get(s.seq_id.rpartition("/")[0])
            if handle is not None and handle.scheduled_time is None:
                handle.scheduled_time = now
                self.usage.started(handle)
        last, ex.last_step_time = ex.last_step_time, now
        self.metrics.on_step(
            now,
            now - last if last else None,
            out.total_num_scheduled_tokens,
            len(resp.sampled) + len(resp.decode_token_ids),
            record.first_tokens,
        )
        self._handle_scheduler_finished(ex, record)
        for handle in done:
            if not handle.finished_in_engine:
                self.finish_request(handle, record)
        # Written once the next step is on its way (see _loop), or when the loop goes idle.
        self.persister.submit(record.to_record(), wake=False)

    def _handle_scheduler_finished(self, ex: ExecutorHandle, record: EngineStep | None = None):
        """Requests the scheduler core ended on its own (e.g. can never fit the cache)."""
        own = record is None
        record = record or EngineStep()
        for req in ex.sched.take_finished_requests():
            handle = self.requests.get(req.req_id)
            if handle is None or handle.finished_in_engine or handle.executor is not ex:
                continue  # gone, already final, or moved to another executor
            for seq in req.seqs:
                if not handle.seq_finished(seq.index):
                    handle.finish_seq(seq.index, seq.status, seq.stop_reason, record, req.error)
            self.finish_request(handle, record)
        if own:
            self.persister.submit(record.to_record())

    def fail_request(self, handle: RequestHandle, record: EngineStep, error: str) -> None:
        """End every sequence of `handle` with an error finish that tells the client why."""
        for i in range(handle.n):
            handle.finish_seq(i, RequestStatus.FINISHED_ERROR, None, record, error)
        self.finish_request(handle, record)

    def finish_request(self, handle: RequestHandle, record: EngineStep) -> None:
        handle.finished_in_engine = True
        self.usage.finished(handle)
        self.structured.forget(handle.req_id)
        self.metrics.on_finish(handle, time.time())
        record.finishes.append(handle.finish_record())
        # Forget it only once Redis has it: until then it must stay resumable from memory.
        record.after.append(lambda: self.requests.pop(handle.req_id, None))
        log.info("request.finished", req_id=handle.req_id, reasons=handle.finish_reasons())

    # ---------------------------------------------------------------- executor faults (faults.py)

    async def executor_lost(self, ex: ExecutorHandle, reason: str) -> None:
        """`ex` stopped answering or restarted while idle: reconnect it (and recompute)."""
        await faults.executor_lost(self, ex, reason)


@dataclass(slots=True)
class _Sent:
    """A step on its way to an executor."""

    out: SchedulerOutput
    step_id: int  # ExecuteModelRequest.step_id
    call: grpc.aio.UnaryUnaryCall
    sent_at: float  # time.perf_counter()


def _log_task_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "engine.task_failed",
            task=task.get_name(),
            error=repr(task.exception()),
            exc_info=task.exception(),
        )
