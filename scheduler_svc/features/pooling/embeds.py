"""The Embed RPC in the engine: each input runs as a prompt-only pooled request (``params.py``).

Durability: an embedding is not written to Redis. The call is unary and idempotent and its
result depends on nothing but the input (the numerics are step-invariant), so a call that a
scheduler restart or fail-over cuts off fails UNAVAILABLE and is simply made again (the OpenAI
frontend retries it), giving the same vectors bit for bit. Persisting would cost a Redis write
of every vector (kilobytes each) for a result that is cheaper to recompute than to store, and
there is no stream to resume.

The inputs' requests live only in their executor's scheduling core and in ``EmbedRequests``,
never in the request table (whose entries are Redis-backed streams). The step loop hands this
object each step's pooled vectors (``on_pooled``); everything else that can happen to a request
in a core (fail-over or draining moves it, a rebuilt core forgets it, the core ends it as never
fitting) is noticed by the waiting call itself, which checks its requests every
``WATCH_INTERVAL_S`` and queues again those that left their core without a vector.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from protos import executor_pb2 as epb
from scheduler_svc.core.errors import QueueFull, Unavailable, ValidationError
from scheduler_svc.core.request import Request, RequestStatus, req_id_of
from scheduler_svc.engine.config import EngineConfig, scoped_id
from scheduler_svc.engine.faults.lifecycle import Lifecycle
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.fleet.executors import ExecutorPool
from scheduler_svc.engine.key_usage import KeyUsage
from scheduler_svc.engine.model import ModelInfo
from scheduler_svc.features.pooling.params import PoolingParams, PoolingType, embed_request
from scheduler_svc.output.tokenizer import encode_prompt

log = structlog.get_logger(__name__)

__all__ = ["MAX_EMBED_INPUTS", "MAX_REPLY_BYTES", "EmbedInput", "EmbedRequests", "EmbedResult"]

MAX_EMBED_INPUTS = 2048  # as OpenAI's limit on inputs per embeddings call
# Vectors of one reply, in bytes: below the clients' 64 MiB message limit, with room to spare.
MAX_REPLY_BYTES = 48 << 20
WATCH_INTERVAL_S = 0.5
DEFAULT_POOLING = PoolingType.LAST  # vLLM's default for decoder LLMs (with normalize)


@dataclass(slots=True)
class EmbedInput:
    """An Embed call, converted at the edge (api/convert.py does not know it: proto.py)."""

    inputs: list[str | list[int]]  # texts or token-id lists
    pooling: PoolingType | None = None  # None: DEFAULT_POOLING
    normalize: bool = True
    dimensions: int | None = None  # None: all of hidden_size
    priority: int = 0
    owner: str = ""  # the API key's name ("" without keys)


@dataclass(slots=True)
class EmbedResult:
    vectors: list[np.ndarray]  # float32, one per input, in input order
    num_prompt_tokens: list[int]


@dataclass(slots=True, eq=False)
class _Pending:
    """One input of a call: its request in a core (replaced when it is queued again)."""

    req: Request
    ex: ExecutorHandle | None = None  # where it is queued (None until then)
    future: asyncio.Future[np.ndarray] = field(default_factory=asyncio.Future)


class EmbedRequests:
    """The embedding inputs in flight, by request id."""

    def __init__(
        self,
        config: EngineConfig,
        lifecycle: Lifecycle,
        pool: ExecutorPool,
        model: ModelInfo,
        usage: KeyUsage,
        check_available: Callable[[], None],
    ) -> None:
        self.max_waiting = config.max_waiting
        self.lifecycle = lifecycle
        self.pool = pool
        self.model = model
        self.usage = usage
        self.check_available = check_available  # raises Unavailable (requests.RequestFront)
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    async def embed(self, inp: EmbedInput) -> EmbedResult:
        """Every input's vector; raises ValidationError, QueueFull or Unavailable."""
        self.check_available()
        pooling = self._pooling(inp)
        prompts = [self._tokens(i, x) for i, x in enumerate(inp.inputs)]
        num_waiting = sum(ex.sched.num_waiting for ex in self.pool.executors)
        if num_waiting + len(prompts) > self.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.max_waiting} requests)")
        if inp.owner:
            self.usage.check(inp.owner, sum(len(p) for p in prompts))
        base = scoped_id(inp.owner, f"embed-{uuid.uuid4().hex}")
        now = time.time()
        pending = []
        try:
            for i, prompt in enumerate(prompts):
                req = embed_request(
                    f"{base}-{i}", prompt, pooling, priority=inp.priority, arrival_time=now
                )
                pending.append(_Pending(req))
                self._place(pending[-1])
            vectors = await self._wait(pending)
        finally:
            self._forget(pending)
        log.info("embed.done", num_inputs=len(prompts), num_tokens=sum(map(len, prompts)))
        return EmbedResult(vectors, [len(p) for p in prompts])

    # ---------------------------------------------------------------- the step loop's hook

    def on_pooled(self, ex: ExecutorHandle, pooled: list[epb.PooledOutput]) -> None:
        """A step's vectors: each input is finished in its core (its blocks freed, the executor
        told to drop it) and its call gets the vector."""
        for out in pooled:
            # Finished in the core even when no call waits any more (it was cancelled and its
            # abort is still queued): a pooled sequence's prompt is complete, nothing is left
            # to run. False: it ended meanwhile (moved, aborted); the call's watch sees to it.
            if not ex.sched.finish_sequence(out.seq_id, RequestStatus.FINISHED_LENGTH):
                continue
            p = self._pending.get(req_id_of(out.seq_id))
            if p is not None and p.ex is ex and not p.future.done():
                p.future.set_result(np.frombuffer(out.data, dtype="<f4").copy())

    # ---------------------------------------------------------------- internals

    def _pooling(self, inp: EmbedInput) -> PoolingParams:
        if not inp.inputs:
            raise ValidationError("inputs must not be empty")
        if len(inp.inputs) > MAX_EMBED_INPUTS:
            raise ValidationError(
                f"inputs has {len(inp.inputs)} entries; at most {MAX_EMBED_INPUTS} per call"
            )
        hidden_size = self.pool.executors[0].describe.hidden_size
        dims = inp.dimensions
        if dims is not None and not 1 <= dims <= hidden_size:
            raise ValidationError(f"dimensions must be in [1, {hidden_size}], got {dims}")
        if len(inp.inputs) * (dims or hidden_size) * 4 > MAX_REPLY_BYTES:
            raise ValidationError(
                f"{len(inp.inputs)} vectors of {dims or hidden_size} floats exceed the "
                f"{MAX_REPLY_BYTES >> 20} MiB a reply may hold; split the inputs over calls"
            )
        pooling = DEFAULT_POOLING if inp.pooling is None else inp.pooling
        return PoolingParams(pooling, inp.normalize, dims or 0)

    def _tokens(self, i: int, x: str | list[int]) -> list[int]:
        model = self.model
        if isinstance(x, str):
            ids = encode_prompt(model.tokenizer, x) if x else []
        else:
            ids = list(x)
            bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
            if bad is not None:
                raise ValidationError(
                    f"inputs[{i}] contains token id {bad}, outside the vocabulary "
                    f"[0, {model.vocab_size})"
                )
        if not ids:
            raise ValidationError(f"inputs[{i}] is empty")
        # The scheduling core keeps one slot past the prompt (as for a generation's first token).
        limit = model.max_model_len - 1
        if len(ids) > limit:
            raise ValidationError(
                f"inputs[{i}] is {len(ids)} tokens; at most {limit} fit the maximum model "
                f"length {model.max_model_len}"
            )
        return ids

    def _place(self, p: _Pending) -> None:
        """Queue `p.req` on the executor the router picks."""
        p.ex = self.pool.place(p.req)
        if p.req.is_finished:  # the core refused it at once (e.g. it can never fit the cache)
            raise ValidationError(p.req.error or "the input cannot be scheduled")
        self._pending[p.req.req_id] = p

    async def _wait(self, pending: list[_Pending]) -> list[np.ndarray]:
        while True:
            waiting = [p.future for p in pending if not p.future.done()]
            if not waiting:
                return [p.future.result() for p in pending]
            await asyncio.wait(waiting, timeout=WATCH_INTERVAL_S)
            if self.lifecycle.why_not_serving() is not None:
                raise Unavailable("scheduler is shutting down; retry the call")
            for p in pending:
                if p.ex is None or p.future.done():
                    continue
                if p.ex.sched.get_request(p.req.req_id) is not p.req:
                    self._left_core(p)

    def _left_core(self, p: _Pending) -> None:
        """`p` ended in its core without a vector: an error the core chose, or it was moved
        (fail-over, draining) or forgotten (core rebuilt): then it is queued again, anew."""
        req = p.req
        if req.status == RequestStatus.FINISHED_ERROR:
            p.future.set_exception(ValidationError(req.error or "the input cannot be scheduled"))
            return
        pooling = req.sampling_params.pooling  # type: ignore[attr-defined]
        p.req = embed_request(
            req.req_id,
            req.prompt_token_ids,
            pooling,
            priority=req.priority,
            arrival_time=req.arrival_time,
        )
        self._place(p)
        log.info("embed.requeued", req_id=req.req_id, executor=p.ex.address if p.ex else "")

    def _forget(self, pending: list[_Pending]) -> None:
        """Drop the call's inputs; those still in a core (the call failed or was cancelled)
        are aborted there between two steps."""
        unfinished = []
        for p in pending:
            self._pending.pop(p.req.req_id, None)
            if not p.future.done():
                p.future.cancel()
                unfinished.append(p)
        if unfinished:
            task = asyncio.get_running_loop().create_task(_abort(unfinished))
            _background.add(task)
            task.add_done_callback(_background.discard)


_background: set[asyncio.Task] = set()


async def _abort(pending: list[_Pending]) -> None:
    for p in pending:
        if p.ex is None:
            continue
        with contextlib.suppress(Exception):  # best effort: the executor may be gone
            async with p.ex.exclusive():  # never in the middle of its step
                p.ex.sched.abort_request(p.req.req_id)
            p.ex.wake.set()
