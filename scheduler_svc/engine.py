"""The asyncio engine: schedule -> ExecuteModel -> process outputs -> persist -> stream.

One loop per executor, each with its own scheduler core (queues and block tables for that
executor's KV cache). A step's output is handed to the persister and the loop moves on: clients
see tokens only once Redis has acknowledged them, but the next step never waits for Redis
unless the write backlog passes its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import grpc
import structlog

from protos import executor_pb2 as epb
from scheduler_svc import convert, failpoints
from scheduler_svc.detokenizer import token_byte_table
from scheduler_svc.errors import NotFound, QueueFull, Unavailable, ValidationError
from scheduler_svc.executor_pool import ExecutorHandle, ExecutorPool
from scheduler_svc.handles import EngineStep, RequestHandle, RequestView
from scheduler_svc.health import HealthMonitor
from scheduler_svc.persister import Persister
from scheduler_svc.request import Request, RequestStatus
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler_output import SchedulerOutput
from scheduler_svc.step_outputs import process_step_outputs
from scheduler_svc.store import RequestStore, StoredRequest, StoreUnavailable
from scheduler_svc.tokenizer import encode_chat, encode_prompt, load_tokenizer

log = structlog.get_logger(__name__)

MAX_REQUEST_ID_LEN = 256


@dataclass(slots=True)
class EngineConfig:
    executor_addresses: list[str]
    redis_url: str
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_waiting: int = 4096
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    max_logprobs: int = 20
    finished_ttl_s: float = 3600.0
    max_backlog_steps: int = 1024
    step_timeout_s: float = 120.0
    # An executor unreachable this long hands its requests to the live ones (recomputed there).
    executor_failover_s: float = 10.0
    # Also serve executors that register themselves in Redis (llmserve-executor --redis-url),
    # checked every discovery_interval_s; with no executor_addresses, wait for the first one.
    discover_executors: bool = False
    discovery_interval_s: float = 2.0
    # How often health probes Redis (a write) and idle executors (Describe).
    health_interval_s: float = 0.5
    # Caps below what the executor reports (tests use them to force preemption).
    num_device_blocks: int | None = None
    num_cpu_blocks: int | None = None
    max_model_len: int | None = None


@dataclass(slots=True)
class GenerateInput:
    """A Generate call converted from protobuf; exactly one of the prompt fields is set."""

    req_id: str
    params: SamplingParams
    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True
    priority: int = 0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.store = RequestStore(config.redis_url, finished_ttl_s=config.finished_ttl_s)
        self.persister = Persister(
            self.store, max_backlog_steps=config.max_backlog_steps, resync=self._resync_store
        )
        self.pool = ExecutorPool(config, self.store)
        self.executors = self.pool.executors  # the same list
        self.requests: dict[str, RequestHandle] = {}  # active (unfinished or unacknowledged)
        self.tokenizer = None
        self.ready = False
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self.health = HealthMonitor(self, lambda serving: None, interval_s=config.health_interval_s)
        self.eos_token_ids: list[int] = []
        self.max_model_len = 0
        self.vocab_size = 0
        self.block_size = 0

    # ---------------------------------------------------------------- lifecycle

    async def start(self, on_ready_change: Callable[[bool], None] | None = None) -> None:
        if on_ready_change is not None:
            self.health.on_change = on_ready_change
        self.health.update()
        self.persister.start()
        self._spawn(self._connect_all(), "engine.connect")
        self._spawn(self.health.run(), "engine.health")

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
                self.tokenizer = await asyncio.to_thread(load_tokenizer, files)
                # Built here, off the loop, rather than by the first request's detokenizer.
                await asyncio.to_thread(token_byte_table, self.tokenizer)
                if failpoints.ARMED:  # tests widen the window before the limits are known
                    await asyncio.sleep(failpoints.delay("engine.start"))
        first = self.executors[0].describe
        self.eos_token_ids = list(first.eos_token_ids)
        self.vocab_size = first.vocab_size
        self.block_size = first.block_size
        self.max_model_len = min(
            first.max_model_len, self.config.max_model_len or first.max_model_len
        )
        await self._recover()
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

    # ---------------------------------------------------------------- requests

    async def submit(self, inp: GenerateInput) -> tuple[RequestHandle, bool]:
        """The request's handle, and whether this call created it (False: attached to an
        existing request with the same id)."""
        self._check_available()
        req_id = inp.req_id or uuid.uuid4().hex
        if len(req_id) > MAX_REQUEST_ID_LEN or not req_id.isprintable():
            raise ValidationError(
                f"request_id must be printable and at most {MAX_REQUEST_ID_LEN} characters"
            )
        existing = self.requests.get(req_id)
        if existing is not None:
            return existing, False  # same id again: attach, never a second generation
        prompt = await self._prompt_token_ids(inp)
        inp.params.validate(max_logprobs=self.config.max_logprobs, vocab_size=self.vocab_size)
        if sum(ex.sched.num_waiting for ex in self.executors) >= self.config.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.config.max_waiting} requests)")
        handle = RequestHandle(
            req_id=req_id,
            prompt_token_ids=prompt,
            params=inp.params,
            priority=inp.priority,
            arrival_time=time.time(),
        )
        record = StoredRequest(
            req_id=req_id,
            prompt_token_ids=prompt,
            params=convert.params_to_dict(inp.params),
            priority=inp.priority,
            arrival_time=handle.arrival_time,
            n=inp.params.n,
        )
        try:
            created = await self.store.create(record)
        except StoreUnavailable as e:
            raise Unavailable(
                "request store (Redis) is unavailable; the request was not accepted, retry later"
            ) from e
        if not created:
            # Stored by an earlier call (possibly finished): attach to what is stored.
            return await self.attach(req_id), False
        if req_id in self.requests:  # a concurrent duplicate won the race in memory
            return self.requests[req_id], False
        handle.init_outputs(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests[req_id] = handle
        self._enqueue(
            handle,
            Request(
                req_id, prompt, inp.params, priority=inp.priority, arrival_time=handle.arrival_time
            ),
        )
        log.info("request.admitted", req_id=req_id, num_prompt_tokens=len(prompt), n=inp.params.n)
        return handle, True

    async def _prompt_token_ids(self, inp: GenerateInput) -> list[int]:
        if inp.token_ids is not None:
            prompt = list(inp.token_ids)
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValidationError(
                    f"prompt.token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})"
                )
        elif inp.chat is not None:
            try:
                prompt = encode_chat(
                    self.tokenizer, inp.chat, add_generation_prompt=inp.add_generation_prompt
                )
            except ValueError as e:
                raise ValidationError(f"prompt.chat: {e}") from e
        else:
            prompt = encode_prompt(self.tokenizer, inp.text or "")
        if not prompt or (inp.text is not None and not inp.text):
            raise ValidationError("prompt must not be empty")
        if len(prompt) >= self.max_model_len:
            raise ValidationError(
                f"prompt is {len(prompt)} tokens; the maximum model length is "
                f"{self.max_model_len} (prompt + at least one output token)"
            )
        return prompt

    def _check_available(self) -> None:
        self._check_ready()
        if not any(ex.healthy for ex in self.executors):
            raise Unavailable("no executor is reachable")
        if not self.persister.healthy:
            raise Unavailable("request store (Redis) is unavailable; retry later")

    def _enqueue(self, handle: RequestHandle, req: Request) -> None:
        healthy = [ex for ex in self.executors if ex.healthy] or self.executors
        ex = max(healthy, key=lambda e: (e.sched.num_free_blocks, -e.sched.num_waiting))
        handle.executor = ex
        ex.sched.add_request(req)
        ex.wake.set()

    def _check_ready(self) -> None:
        """Requests that read engine state wait for start-up: until recovery has finished, the
        tokenizer, the model's limits and the set of resumed requests are incomplete."""
        if self._stopping:
            raise Unavailable("scheduler is shutting down")
        if not self.ready:
            raise Unavailable(
                "scheduler is starting (connecting executors, recovering requests); retry shortly"
            )

    async def attach(self, req_id: str) -> RequestHandle:
        self._check_ready()
        handle = self.requests.get(req_id)
        if handle is not None:
            return handle
        try:
            rec = await self.store.get(req_id)
        except StoreUnavailable as e:
            raise Unavailable("request store (Redis) is unavailable; retry later") from e
        if rec is None:
            raise NotFound(f"request {req_id!r} not found (unknown or expired)")
        handle = RequestHandle.from_stored(rec, convert.params_from_dict(rec.params))
        handle.replay_outputs(self.tokenizer, self.eos_token_ids, self.max_model_len, rec)
        if not rec.finished:
            # Stored but not (yet) resumed in this process: nothing new will arrive here.
            handle.close(f"request {req_id!r} is not running on this scheduler yet; retry")
        return handle

    async def abort(self, req_id: str, *, missing_ok: bool = False) -> bool:
        if not self.ready and not self._stopping:  # while stopping, the state is still whole
            if missing_ok:  # a stream that went away during start-up: nothing of it runs yet
                return False
            self._check_ready()
        handle = self.requests.get(req_id)
        if handle is None or handle.finished_in_engine:
            if missing_ok or handle is not None:
                return False
            try:
                if await self.store.exists(req_id):
                    return False
            except StoreUnavailable as e:
                raise Unavailable("request store (Redis) is unavailable") from e
            raise NotFound(f"request {req_id!r} not found (unknown or expired)")
        ex = handle.executor
        async with ex.lock:  # never in the middle of this executor's step
            if handle.finished_in_engine:
                return False
            ex.sched.abort_request(req_id)
            record = EngineStep()
            for index in range(handle.n):
                handle.finish_seq(index, RequestStatus.FINISHED_ABORTED, None, record)
            self._finish_request(handle, record)
            self.persister.submit(record.to_record())
        ex.wake.set()
        log.info("request.aborted", req_id=req_id)
        return True

    async def get_request(self, req_id: str) -> RequestView:
        self._check_ready()
        try:
            rec = await self.store.get(req_id)
        except StoreUnavailable as e:
            handle = self.requests.get(req_id)
            if handle is None:
                raise Unavailable("request store (Redis) is unavailable") from e
            return handle.view()
        if rec is None:
            raise NotFound(f"request {req_id!r} not found (unknown or expired)")
        handle = self.requests.get(req_id)
        if handle is not None:
            return handle.view()
        params = convert.params_from_dict(rec.params)
        return RequestView.from_stored(
            rec, params, self.tokenizer, self.eos_token_ids, self.max_model_len
        )

    def server_info(self) -> dict:
        self._check_ready()
        d = self.executors[0].describe
        stats = [ex.sched.get_stats() for ex in self.executors]
        hits = sum(st.prefix_cache_hits for st in stats)
        queries = sum(st.prefix_cache_queries for st in stats)
        total = sum(ex.sched.num_device_blocks for ex in self.executors)
        free = sum(ex.sched.num_free_blocks for ex in self.executors)
        return {
            "model": d.model_name,
            "max_model_len": self.max_model_len,
            "block_size": d.block_size,
            "num_waiting": sum(ex.sched.num_waiting for ex in self.executors),
            "num_running": sum(ex.sched.num_running for ex in self.executors),
            "num_swapped": sum(ex.sched.num_swapped for ex in self.executors),
            "kv_cache_usage": 1.0 - free / total if total else 0.0,
            "executors": [
                {
                    "address": ex.address,
                    "instance_id": ex.describe.instance_id,
                    "num_device_blocks": ex.sched.num_device_blocks,
                    "num_free_blocks": ex.sched.num_free_blocks,
                    "num_cpu_blocks": ex.describe.num_cpu_blocks,
                    "healthy": ex.healthy,
                }
                for ex in self.executors
            ],
            "max_logprobs": self.config.max_logprobs,
            "vocab_size": self.vocab_size,
            "policy": self.config.policy,
            "preemption_mode": self.config.preemption_mode,
            "num_preemptions": sum(ex.sched.num_preemptions for ex in self.executors),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        }

    # ---------------------------------------------------------------- recovery

    async def _recover(self) -> None:
        """Resume every unfinished request found in Redis by recompute."""
        while True:
            try:
                stored = await self.store.list_unfinished()
                break
            except StoreUnavailable:
                log.warning("engine.recover.waiting_for_store")
                await asyncio.sleep(0.5)
        for rec in stored:
            params = convert.params_from_dict(rec.params)
            handle = RequestHandle.from_stored(rec, params)
            record = EngineStep()
            handle.replay_outputs(self.tokenizer, self.eos_token_ids, self.max_model_len, rec)
            self.requests[rec.req_id] = handle
            if handle.all_finished:
                # It had produced its last token before the crash, but the finish record was
                # not written yet.
                self._finish_request(handle, record)
                self.persister.submit(record.to_record())
                continue
            self._enqueue(handle, self._resumed_request(handle, handle.acked_outputs()))
            log.info("request.resumed", req_id=rec.req_id, num_output_tokens=handle.num_acked)

    @staticmethod
    def _resumed_request(handle: RequestHandle, outputs: list[list[int]]) -> Request:
        """A scheduler-core request that recomputes `handle`'s prompt plus `outputs`."""
        req = Request(
            handle.req_id,
            handle.prompt_token_ids,
            handle.params,
            priority=handle.priority,
            arrival_time=handle.arrival_time,
            output_token_ids=[list(o) for o in outputs],
        )
        for seq, state in zip(req.seqs, handle.states, strict=True):
            if state.finished:  # n > 1: this one had finished already
                seq.status = RequestStatus[state.finish_status.name]
        return req

    async def _resync_store(self) -> None:
        """Rewrite every active request to Redis from memory (Redis lost acknowledged data)."""
        for handle in list(self.requests.values()):
            rec = StoredRequest(
                req_id=handle.req_id,
                prompt_token_ids=handle.prompt_token_ids,
                params=convert.params_to_dict(handle.params),
                priority=handle.priority,
                arrival_time=handle.arrival_time,
                n=handle.n,
            )
            await self.store.create(rec)
            await self.store.rewrite_outputs(handle.req_id, handle.acked_outputs())

    # ---------------------------------------------------------------- the loop

    async def _loop(self, ex: ExecutorHandle) -> None:
        while not self._stopping:
            if not ex.healthy:
                self.persister.kick()
                await self._reconnect(ex)
                if not ex.healthy:
                    self._fail_over(ex)
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

    async def _step(self, ex: ExecutorHandle) -> bool:
        """One engine step on `ex` (its lock held); True when there was nothing to do."""
        out = None
        record = EngineStep()
        try:
            if failpoints.ARMED:
                failpoints.hit("engine.schedule")
            out = ex.sched.schedule()
            self._handle_scheduler_finished(ex)
            if out.is_empty:
                return True
            ex.step_id += 1
            msg = convert.execute_request(out, ex.step_id)
            msg.instance_id = ex.describe.instance_id
            call = ex.stub.ExecuteModel(msg, timeout=self.config.step_timeout_s)
            # The previous step's Redis write goes out now, while the executor computes (its
            # record was queued without waking the writer).
            self.persister.kick()
            try:
                resp = await call
            except grpc.aio.AioRpcError as e:
                self.persister.kick()
                self._executor_failed(ex, e)
                return False
            ex.consecutive_failures = 0
            if failpoints.ARMED:
                failpoints.hit("engine.process_step")
            self._process_step(ex, out, resp, record)
            ex.num_crashed_steps = 0
        except Exception as e:
            self._step_crashed(ex, out, record, e)
            await self._reset_executor(ex)
        return False

    def _step_crashed(
        self, ex: ExecutorHandle, out: SchedulerOutput | None, record: EngineStep, error: Exception
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
        for handle in list(self.requests.values()):
            if handle.executor is not ex or handle.finished_in_engine:
                continue
            if give_up or handle.req_id in in_step:
                self._fail_request(
                    handle, record, "internal error in the scheduler while running this request"
                )
        self.persister.submit(record.to_record())
        self._rebuild_core(ex)

    def _rebuild_core(self, ex: ExecutorHandle) -> None:
        """Give `ex` a fresh scheduler core sized from its current Describe and queue its
        unfinished requests there, to be recomputed from the tokens they have produced. The
        executor must be Reset before its next step (the caller's job)."""
        ex.sched = self.pool.new_scheduler(ex.describe)
        record = EngineStep()
        handles = [h for h in self.requests.values() if h.executor is ex]
        for handle in sorted(handles, key=lambda h: h.arrival_time):
            if handle.finished_in_engine:
                continue
            if handle.all_finished:  # its last token was processed, its finish was not
                self._finish_request(handle, record)
                continue
            ex.sched.add_request(self._resumed_request(handle, handle.produced_outputs()))
        self.persister.submit(record.to_record())
        ex.wake.set()
        log.warning("executor.core_rebuilt", address=ex.address, requeued=ex.sched.num_waiting)

    async def _reset_executor(self, ex: ExecutorHandle) -> None:
        try:
            await ex.stub.Reset(epb.ResetRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            self._executor_failed(ex, e)

    async def executor_lost(self, ex: ExecutorHandle, reason: str) -> None:
        """`ex` stopped answering or restarted while idle: reconnect it (and recompute)."""
        async with ex.lock:
            if not ex.healthy:
                return
            log.warning("executor.lost", address=ex.address, reason=reason)
            ex.unhealthy_since = time.monotonic()
            ex.healthy = False
            ex.sched.reset_executor()
        self.health.update()
        ex.wake.set()

    def _process_step(
        self,
        ex: ExecutorHandle,
        out: SchedulerOutput,
        resp: epb.ExecuteModelResponse,
        record: EngineStep,
    ) -> None:
        done = process_step_outputs(ex.sched, self.requests, out, resp, record)
        self._handle_scheduler_finished(ex, record)
        for handle in done:
            if not handle.finished_in_engine:
                self._finish_request(handle, record)
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
            self._finish_request(handle, record)
        if own:
            self.persister.submit(record.to_record())

    def _fail_request(self, handle: RequestHandle, record: EngineStep, error: str) -> None:
        """End every sequence of `handle` with an error finish that tells the client why."""
        for i in range(handle.n):
            handle.finish_seq(i, RequestStatus.FINISHED_ERROR, None, record, error)
        self._finish_request(handle, record)

    def _finish_request(self, handle: RequestHandle, record: EngineStep) -> None:
        handle.finished_in_engine = True
        record.finishes.append(handle.finish_record())
        # Forget it only once Redis has it: until then it must stay resumable from memory.
        record.after.append(lambda: self.requests.pop(handle.req_id, None))
        log.info("request.finished", req_id=handle.req_id, reasons=handle.finish_reasons())

    def _executor_failed(self, ex: ExecutorHandle, e: grpc.aio.AioRpcError) -> None:
        ex.consecutive_failures += 1
        log.error(
            "executor.step_failed", address=ex.address, code=e.code().name, details=e.details()
        )
        if ex.healthy:
            ex.unhealthy_since = time.monotonic()
        ex.healthy = False
        # Its KV cache (or our view of it) can no longer be trusted: recompute everything.
        ex.sched.reset_executor()
        self.health.update()

    def _fail_over(self, ex: ExecutorHandle) -> None:
        """Move the requests of an executor unreachable for `executor_failover_s` to live ones.

        Its KV cache is gone either way; elsewhere each request is recomputed from its prompt
        and the tokens produced so far, so its output continues exactly as it would have.
        """
        if time.monotonic() - ex.unhealthy_since < self.config.executor_failover_s:
            return
        if not any(e.healthy for e in self.executors if e is not ex):
            return
        moved = 0
        for req_id in ex.sched.unfinished_request_ids():
            handle = self.requests.get(req_id)
            ex.sched.abort_request(req_id)  # frees its blocks here; not reported (see below)
            if handle is None or handle.finished_in_engine:
                continue
            # _enqueue points handle.executor elsewhere, which is how
            # _handle_scheduler_finished knows to ignore the abort above.
            self._enqueue(handle, self._resumed_request(handle, handle.produced_outputs()))
            moved += 1
        if moved:
            log.warning("executor.failed_over", address=ex.address, moved_requests=moved)

    async def _reconnect(self, ex: ExecutorHandle) -> None:
        await asyncio.sleep(min(0.1 * 2**ex.consecutive_failures, 2.0))
        try:
            describe = await ex.stub.Describe(epb.DescribeRequest(), timeout=5)
            await ex.stub.Reset(epb.ResetRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return
        if describe.instance_id != ex.describe.instance_id:
            log.warning("executor.restarted", address=ex.address, instance_id=describe.instance_id)
        old, ex.describe = ex.describe, describe
        if _capacity(describe) != _capacity(old):
            # Restarted with another cache shape: the old core's block ids may not even exist
            # there. A fresh core sized for it; the requests are recomputed.
            async with ex.lock:
                self._rebuild_core(ex)
        ex.healthy = True
        self.health.update()
        ex.wake.set()
        if ex.consecutive_failures >= 3:
            # The same step keeps failing: fail what is running rather than loop forever.
            record = EngineStep()
            for req_id in list(ex.sched.running_request_ids()):
                handle = self.requests.get(req_id)
                if handle is not None and not handle.finished_in_engine:
                    ex.sched.abort_request(req_id)
                    self._fail_request(handle, record, "executor rejected the request repeatedly")
            self.persister.submit(record.to_record())
            ex.consecutive_failures = 0


def _capacity(d: epb.DescribeResponse) -> tuple[int, int, int, int]:
    return (d.block_size, d.num_device_blocks, d.num_cpu_blocks, d.max_model_len)


def _log_task_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "engine.task_failed",
            task=task.get_name(),
            error=repr(task.exception()),
            exc_info=task.exception(),
        )


__all__ = ["Engine", "EngineConfig", "GenerateInput"]
