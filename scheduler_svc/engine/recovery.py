"""Recompute: how requests survive the loss of a scheduler, an executor or Redis's data.

Every path ends the same way: a fresh scheduler-core `Request` holding the prompt plus the
tokens produced so far, queued on some executor's core, where its KV cache is rebuilt by
prefill. Outputs continue exactly: greedy is deterministic, and seeded sampling depends only on
(seed, output position).

- `recover`: a scheduler start resumes every unfinished request stored in Redis.
- `rebuild_core`: an executor whose state is unknown (a crashed step, another cache shape)
  gets a fresh core holding its requests.
- `fail_over`: the requests of an executor unreachable for too long move to live ones.
- `resync_store`: Redis lost data it had acknowledged; rewrite it from memory.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.requests import enqueue
from scheduler_svc.engine.streams import EngineStep, RequestHandle
from scheduler_svc.state.store import StoredRequest, StoreUnavailable

if TYPE_CHECKING:
    from scheduler_svc.engine.engine import Engine
    from scheduler_svc.engine.executors import ExecutorHandle

log = structlog.get_logger(__name__)

__all__ = ["fail_over", "rebuild_core", "recover", "resumed_request", "resync_store"]


def resumed_request(handle: RequestHandle, outputs: list[list[int]]) -> Request:
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
            seq.status = state.finish_status
    return req


async def recover(engine: Engine) -> None:
    """Resume every unfinished request found in Redis by recompute (scheduler start-up)."""
    while True:
        try:
            stored = await engine.store.list_unfinished()
            break
        except StoreUnavailable:
            log.warning("engine.recover.waiting_for_store")
            await asyncio.sleep(0.5)
    for rec in stored:
        handle = RequestHandle.from_stored(rec, SamplingParams.from_dict(rec.params))
        handle.replay_outputs(engine.tokenizer, engine.eos_token_ids, engine.max_model_len, rec)
        engine.requests[rec.req_id] = handle
        if handle.all_finished:
            # It had produced its last token before the crash; its finish was not written yet.
            record = EngineStep()
            engine.finish_request(handle, record)
            engine.persister.submit(record.to_record())
            continue
        # From what clients may have seen (acknowledged), not more: nothing else survived.
        enqueue(engine, handle, resumed_request(handle, handle.acked_outputs()))
        engine.usage.admitted(handle)
        engine.metrics.recovered += 1
        log.info("request.resumed", req_id=rec.req_id, num_output_tokens=handle.num_acked)


def rebuild_core(engine: Engine, ex: ExecutorHandle) -> None:
    """Give `ex` a fresh scheduler core sized from its current Describe and queue its
    unfinished requests there, to be recomputed from the tokens they have produced. The
    executor must be Reset before its next step (the caller's job)."""
    ex.sched = engine.pool.new_scheduler(ex.describe)
    record = EngineStep()
    handles = [h for h in engine.requests.values() if h.executor is ex]
    for handle in sorted(handles, key=lambda h: h.arrival_time):
        if handle.finished_in_engine:
            continue
        if handle.all_finished:  # its last token was processed, its finish was not
            engine.finish_request(handle, record)
            continue
        ex.sched.add_request(resumed_request(handle, handle.produced_outputs()))
    engine.persister.submit(record.to_record())
    ex.wake.set()
    log.warning("executor.core_rebuilt", address=ex.address, requeued=ex.sched.num_waiting)


def fail_over(engine: Engine, ex: ExecutorHandle) -> None:
    """Move the requests of `ex` (unreachable for too long) to the live executors.

    Its KV cache is gone either way; elsewhere each request is recomputed from its prompt and
    the tokens produced so far, so its output continues exactly as it would have.
    """
    moved = 0
    for req_id in ex.sched.unfinished_request_ids():
        handle = engine.requests.get(req_id)
        ex.sched.abort_request(req_id)  # frees its blocks here; not reported (see below)
        if handle is None or handle.finished_in_engine:
            continue
        # enqueue points handle.executor elsewhere, which is how the loop knows to ignore the
        # abort above when the old core reports it.
        enqueue(engine, handle, resumed_request(handle, handle.produced_outputs()))
        moved += 1
    if moved:
        engine.metrics.failovers += 1
        log.warning("executor.failed_over", address=ex.address, moved_requests=moved)


def move_waiting(engine: Engine, ex: ExecutorHandle) -> None:
    """`ex` is draining: the requests it has not started go to executors taking new work.

    What it is running stays and finishes there while it drains; when it stops, fail-over moves
    whatever is left (at once: a draining executor is not coming back).
    """
    if not any(e.healthy and not e.draining for e in engine.executors if e is not ex):
        return  # nowhere to go: they wait for it, or for the fail-over
    moved = 0
    for req_id in ex.sched.waiting_request_ids():
        handle = engine.requests.get(req_id)
        ex.sched.abort_request(req_id)  # not reported: enqueue points the handle elsewhere
        if handle is None or handle.finished_in_engine:
            continue
        enqueue(engine, handle, resumed_request(handle, handle.produced_outputs()))
        moved += 1
    if moved:
        log.info("executor.draining.moved_waiting", address=ex.address, moved_requests=moved)


async def resync_store(engine: Engine) -> None:
    """Rewrite every active request to Redis from memory (Redis lost acknowledged data)."""
    for handle in list(engine.requests.values()):
        rec = StoredRequest(
            req_id=handle.req_id,
            prompt_token_ids=handle.prompt_token_ids,
            params=handle.params.to_dict(),
            priority=handle.priority,
            arrival_time=handle.arrival_time,
            n=handle.n,
        )
        await engine.store.create(rec, honour_abort=False)  # it runs: no abort may end it
        await engine.store.rewrite_outputs(handle.req_id, handle.acked_outputs())
