"""The engine's request API: what the servicer calls (submit, attach, abort, get, info).

Each function takes the engine whose state it reads; none of them runs a step. Everything that
reads engine state first checks that start-up has finished (`check_ready`): until recovery is
done the tokenizer, the model's limits and the set of resumed requests are incomplete.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import structlog

from scheduler_svc.core.errors import NotFound, QueueFull, Unavailable, ValidationError
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.config import (
    MAX_REQUEST_ID_LEN,
    ExecutorInfo,
    GenerateInput,
    ServerInfo,
    public_id,
    scoped_id,
)
from scheduler_svc.engine.streams import EngineStep, RequestHandle, RequestView
from scheduler_svc.output.tokenizer import encode_chat, encode_prompt
from scheduler_svc.state.store import Created, StoredRequest, StoreFenced, StoreUnavailable

if TYPE_CHECKING:
    from scheduler_svc.engine.engine import Engine

log = structlog.get_logger(__name__)

__all__ = [
    "attach",
    "check_available",
    "check_ready",
    "detokenize",
    "enqueue",
    "get_request",
    "server_info",
    "submit",
    "tokenize",
]


async def submit(engine: Engine, inp: GenerateInput) -> tuple[RequestHandle, bool]:
    """The request's handle, and whether this call created it (False: attached to an
    existing request with the same id)."""
    check_available(engine)
    given = inp.req_id or uuid.uuid4().hex
    if len(given) > MAX_REQUEST_ID_LEN or not given.isprintable():
        raise ValidationError(
            f"request_id must be printable and at most {MAX_REQUEST_ID_LEN} characters"
        )
    req_id = scoped_id(inp.owner, given)
    existing = engine.requests.get(req_id)
    if existing is not None:
        return existing, False  # same id again: attach, never a second generation
    prompt = await _prompt_token_ids(engine, inp)
    inp.params.validate(max_logprobs=engine.config.max_logprobs, vocab_size=engine.vocab_size)
    await engine.structured.validate(inp.params)
    if sum(ex.sched.num_waiting for ex in engine.executors) >= engine.config.max_waiting:
        raise QueueFull(f"waiting queue is full ({engine.config.max_waiting} requests)")
    if inp.owner:
        engine.usage.check(inp.owner, len(prompt))
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
        params=inp.params.to_dict(),
        priority=inp.priority,
        arrival_time=handle.arrival_time,
        n=inp.params.n,
    )
    # Held until the handle is registered: an abort of this id waits for that rather than
    # finding neither a handle nor a stored request (engine/aborts.py).
    with engine.creating.hold(req_id):
        try:
            created = await engine.store.create(record)
        except StoreFenced as e:
            engine.leadership_lost(f"a write was refused: {e}")
            raise Unavailable("this scheduler is no longer the leader; retry") from e
        except StoreUnavailable as e:
            raise Unavailable(
                "request store (Redis) is unavailable; the request was not accepted, retry later"
            ) from e
        if created is Created.EXISTS:
            # Stored by an earlier call (possibly finished): attach to what is stored.
            return await attach(engine, req_id), False
        if req_id in engine.requests:  # a concurrent duplicate won the race in memory
            return engine.requests[req_id], False
        handle.init_outputs(engine.tokenizer, engine.eos_token_ids, engine.max_model_len)
        if created is Created.ABORTED:
            return _aborted_ahead(handle), True
        engine.requests[req_id] = handle
        engine.usage.admitted(handle)
        enqueue(
            engine,
            handle,
            Request(
                req_id, prompt, inp.params, priority=inp.priority, arrival_time=handle.arrival_time
            ),
        )
    log.info("request.admitted", req_id=req_id, num_prompt_tokens=len(prompt), n=inp.params.n)
    return handle, True


def _aborted_ahead(handle: RequestHandle) -> RequestHandle:
    """A request an earlier abort ended before it began: Redis stored it finished as aborted
    (no tokens), so its stream ends at once and nothing of it is ever scheduled."""
    record = EngineStep()
    for index in range(handle.n):
        handle.finish_seq(index, RequestStatus.FINISHED_ABORTED, None, record)
    record.publish()  # Redis holds the finish already: the claim wrote it
    handle.finished_in_engine = True
    log.info("request.aborted_before_start", req_id=handle.req_id)
    return handle


async def tokenize(engine: Engine, inp: GenerateInput) -> list[int]:
    """The prompt's token ids exactly as submit() would compute them (no length check)."""
    check_ready(engine)
    return _encode(engine, inp)


def detokenize(
    engine: Engine, token_ids: list[int], skip_special_tokens: bool
) -> tuple[str, list[str]]:
    """The text of `token_ids`, and each token's own text."""
    check_ready(engine)
    _check_vocab(engine, token_ids, "token_ids")
    tok = engine.tokenizer
    text = tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
    pieces = [tok.decode([t], skip_special_tokens=False) for t in token_ids]
    return text, pieces


def _check_vocab(engine: Engine, token_ids: list[int], what: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise ValidationError(
            f"{what} contains {bad}, outside the vocabulary [0, {engine.vocab_size})"
        )


def _encode(engine: Engine, inp: GenerateInput) -> list[int]:
    if inp.token_ids is not None:
        prompt = list(inp.token_ids)
        _check_vocab(engine, prompt, "prompt.token_ids")
    elif inp.chat is not None:
        try:
            prompt = encode_chat(
                engine.tokenizer, inp.chat, add_generation_prompt=inp.add_generation_prompt
            )
        except ValueError as e:
            raise ValidationError(f"prompt.chat: {e}") from e
    else:
        prompt = encode_prompt(engine.tokenizer, inp.text or "")
    return prompt


async def _prompt_token_ids(engine: Engine, inp: GenerateInput) -> list[int]:
    prompt = _encode(engine, inp)
    if not prompt or (inp.text is not None and not inp.text):
        raise ValidationError("prompt must not be empty")
    if len(prompt) >= engine.max_model_len:
        raise ValidationError(
            f"prompt is {len(prompt)} tokens; the maximum model length is "
            f"{engine.max_model_len} (prompt + at least one output token)"
        )
    return prompt


def check_available(engine: Engine) -> None:
    check_ready(engine)
    if not any(ex.healthy for ex in engine.executors):
        raise Unavailable("no executor is reachable")
    if not engine.persister.healthy:
        raise Unavailable("request store (Redis) is unavailable; retry later")


def enqueue(engine: Engine, handle: RequestHandle, req: Request) -> None:
    ex = engine.router.choose(engine.executors, req)
    handle.executor = ex
    ex.sched.add_request(req)
    ex.wake.set()


def check_ready(engine: Engine) -> None:
    """Requests that read engine state wait for start-up: until recovery has finished, the
    tokenizer, the model's limits and the set of resumed requests are incomplete."""
    if engine.standby:
        raise Unavailable("standby scheduler: another scheduler holds the leader lease")
    if engine.lost_leadership is not None:
        raise Unavailable("this scheduler is no longer the leader; retry")
    if engine.stopping:
        raise Unavailable("scheduler is shutting down")
    if not engine.ready:
        raise Unavailable(
            "scheduler is starting (connecting executors, recovering requests); retry shortly"
        )


async def attach(engine: Engine, req_id: str) -> RequestHandle:
    check_ready(engine)
    handle = engine.requests.get(req_id)
    if handle is not None:
        return handle
    try:
        rec = await engine.store.get(req_id)
    except StoreUnavailable as e:
        raise Unavailable("request store (Redis) is unavailable; retry later") from e
    if rec is None:
        raise NotFound(f"request {public_id(req_id)!r} not found (unknown or expired)")
    handle = RequestHandle.from_stored(rec, SamplingParams.from_dict(rec.params))
    handle.replay_outputs(engine.tokenizer, engine.eos_token_ids, engine.max_model_len, rec)
    if not rec.finished:
        # Stored but not (yet) resumed in this process: nothing new will arrive here.
        handle.close(f"request {public_id(req_id)!r} is not running on this scheduler yet; retry")
    return handle


async def get_request(engine: Engine, req_id: str) -> RequestView:
    check_ready(engine)
    try:
        rec = await engine.store.get(req_id)
    except StoreUnavailable as e:
        handle = engine.requests.get(req_id)
        if handle is None:
            raise Unavailable("request store (Redis) is unavailable") from e
        return handle.view()
    if rec is None:
        raise NotFound(f"request {public_id(req_id)!r} not found (unknown or expired)")
    handle = engine.requests.get(req_id)
    if handle is not None:
        return handle.view()
    params = SamplingParams.from_dict(rec.params)
    return RequestView.from_stored(
        rec, params, engine.tokenizer, engine.eos_token_ids, engine.max_model_len
    )


def server_info(engine: Engine) -> ServerInfo:
    check_ready(engine)
    executors = engine.executors
    d = executors[0].describe
    stats = [ex.sched.get_stats() for ex in executors]
    hits = sum(st.prefix_cache_hits for st in stats)
    queries = sum(st.prefix_cache_queries for st in stats)
    total = sum(ex.sched.num_device_blocks for ex in executors)
    free = sum(ex.sched.num_free_blocks for ex in executors)
    return ServerInfo(
        model=d.model_name,
        max_model_len=engine.max_model_len,
        block_size=d.block_size,
        num_waiting=sum(ex.sched.num_waiting for ex in executors),
        num_running=sum(ex.sched.num_running for ex in executors),
        num_swapped=sum(ex.sched.num_swapped for ex in executors),
        kv_cache_usage=1.0 - free / total if total else 0.0,
        executors=[
            ExecutorInfo(
                address=ex.address,
                instance_id=ex.describe.instance_id,
                num_device_blocks=ex.sched.num_device_blocks,
                num_free_blocks=ex.sched.num_free_blocks,
                num_cpu_blocks=ex.describe.num_cpu_blocks,
                healthy=ex.healthy,
                prefix_cache_queries=ex.sched.block_manager.prefix_cache_queries,
                prefix_cache_hits=ex.sched.block_manager.prefix_cache_hits,
                draining=ex.draining,
            )
            for ex in executors
        ],
        routing=engine.config.routing,
        max_logprobs=engine.config.max_logprobs,
        vocab_size=engine.vocab_size,
        policy=engine.config.policy,
        preemption_mode=engine.config.preemption_mode,
        num_preemptions=sum(ex.sched.num_preemptions for ex in executors),
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
    )
