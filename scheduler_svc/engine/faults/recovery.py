"""Recompute: how requests survive the loss of a scheduler, an executor or Redis's data.

Every path ends the same way: a fresh scheduler-core `Request` holding the prompt plus the
tokens produced so far, queued on some executor's core, where its KV cache is rebuilt by
prefill. Outputs continue exactly: greedy is deterministic, and seeded sampling depends only on
(seed, output position).

- `recover`: a scheduler start resumes every unfinished request stored in Redis.
- `rebuild_core`: an executor whose state is unknown (a crashed step, another cache shape)
  gets a fresh core holding its requests.
- `fail_over`: the requests of an executor unreachable for too long move to live ones.
- `move_waiting`: a draining executor's requests that have not started move to others.
- `resync_store`: Redis lost data it had acknowledged; rewrite it from memory.
"""

from __future__ import annotations

import asyncio

import structlog

from scheduler_svc import tracing
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.fleet.executors import ExecutorPool
from scheduler_svc.engine.metrics import EngineMetrics
from scheduler_svc.engine.model import ModelInfo
from scheduler_svc.engine.request_table import RequestTable
from scheduler_svc.engine.streams import EngineStep, RequestHandle
from scheduler_svc.features.base import NO_FEATURES, Features
from scheduler_svc.state.persister import Persister
from scheduler_svc.state.store import RequestStore, StoreUnavailable

log = structlog.get_logger(__name__)

__all__ = ["Recovery", "resumed_request"]


def resumed_request(handle: RequestHandle, outputs: list[list[int]]) -> Request:
    """A scheduler-core request that recomputes `handle`'s prompt plus `outputs`."""
    req = Request.of(handle, [list(o) for o in outputs])
    for seq, state in zip(req.seqs, handle.states, strict=True):
        if state.finished:  # n > 1: this one had finished already
            seq.status = state.finish_status
    return req


class Recovery:
    def __init__(
        self,
        table: RequestTable,
        pool: ExecutorPool,
        persister: Persister,
        store: RequestStore,
        model: ModelInfo,
        metrics: EngineMetrics,
    ) -> None:
        self.table = table
        self.pool = pool
        self.persister = persister
        self.store = store
        self.model = model
        self.metrics = metrics
        self.features: Features = (
            NO_FEATURES  # what they keep with a stored request, how they resume (set by the engine)
        )

    def enqueue(self, handle: RequestHandle, req: Request, *, lost_kv: bool = True) -> None:
        """Queue `req` (the core's side of `handle`) where the router sends it; `lost_kv`:
        what it had computed is gone with this move (counted as recomputed)."""
        if lost_kv:
            self.count_recompute(handle, req)
        handle.executor = self.pool.place(req)

    def count_recompute(self, handle: RequestHandle, req: Request) -> None:
        """`llmserve:prompt_tokens_recomputed`: the tokens a request that had started (or has
        output) computes again, its prompt and its outputs but the last (never computed)."""
        if handle.scheduled_time is None and not any(s.num_output_tokens for s in req.seqs):
            return
        for seq in req.live_seqs:
            self.metrics.recomputed_tokens += seq.num_tokens - (seq.num_output_tokens > 0)

    async def recover(self) -> None:
        """Resume every unfinished request found in Redis by recompute (scheduler start-up)."""
        while True:
            try:
                stored = await self.store.list_unfinished()
                break
            except StoreUnavailable:
                log.warning("engine.recover.waiting_for_store")
                await asyncio.sleep(0.5)
        m = self.model
        for rec in stored:
            handle = RequestHandle.from_stored(rec, SamplingParams.from_dict(rec.params))
            self.features.restore(handle, rec.features)  # before admit reads the entries
            handle.replay_outputs(m.tokenizer, m.eos_token_ids, m.max_model_len, rec)
            self.table.add(handle)
            tracing.request_recovered(handle)  # linked to its stored trace context
            # From what clients may have seen (acknowledged), not more: nothing else survived.
            req, record = resumed_request(handle, handle.acked_outputs()), EngineStep()
            for resumed in self.features.resumed:  # e.g. a sequence its stored tokens complete
                resumed(handle, req, record)
            if handle.all_finished:
                # It had produced its last token before the crash; its finish was not written.
                self.table.finish(handle, record)
                self.persister.submit(record)
                continue
            self.persister.submit(record)  # a sequence of n > 1 that ended above, if any
            self.enqueue(handle, req)
            self.table.usage.admitted(handle)
            self.metrics.recovered += 1
            log.info("request.resumed", req_id=rec.req_id, num_output_tokens=handle.num_acked)

    def rebuild_core(self, ex: ExecutorHandle) -> None:
        """Give `ex` a fresh scheduler core sized from its current Describe and queue its
        unfinished requests there, to be recomputed from the tokens they have produced. The
        executor must be Reset before its next step (the caller's job)."""
        ex.sched = self.pool.new_scheduler(ex.describe)
        record = EngineStep()
        for handle in sorted(self.table.on_executor(ex), key=lambda h: h.arrival_time):
            if handle.finished_in_engine:
                continue
            if handle.all_finished:  # its last token was processed, its finish was not
                self.table.finish(handle, record)
                continue
            req = resumed_request(handle, handle.produced_outputs())
            self.count_recompute(handle, req)
            ex.sched.add_request(req)
        self.persister.submit(record)
        ex.wake.set()
        log.warning("executor.core_rebuilt", address=ex.address, requeued=ex.sched.num_waiting)

    def fail_over(self, ex: ExecutorHandle) -> None:
        """Move the requests of `ex` (unreachable for too long) to the live executors.

        Its KV cache is gone either way; elsewhere each request is recomputed from its prompt
        and the tokens produced so far, so its output continues exactly as it would have.
        """
        moved = self._move(ex, ex.sched.unfinished_request_ids())
        if moved:
            self.metrics.failovers += 1
            log.warning("executor.failed_over", address=ex.address, moved_requests=moved)

    def move_waiting(self, ex: ExecutorHandle) -> None:
        """`ex` is draining: the requests it has not started go to executors taking new work.

        What it is running stays and finishes there while it drains; when it stops, fail-over
        moves whatever is left (at once: a draining executor is not coming back).
        """
        if not any(e.healthy and not e.draining for e in self.pool.executors if e is not ex):
            return  # nowhere to go: they wait for it, or for the fail-over
        # Waiting requests hold no KV (never computed, or dropped by a preemption, which is
        # not a recovery): moving them recomputes nothing that was not to be recomputed anyway.
        moved = self._move(ex, ex.sched.waiting_request_ids(), lost_kv=False)
        if moved:
            log.info("executor.draining.moved_waiting", address=ex.address, moved_requests=moved)

    def _move(self, ex: ExecutorHandle, req_ids: list[str], *, lost_kv: bool = True) -> int:
        moved = 0
        for req_id in req_ids:
            handle = self.table.get(req_id)
            ex.sched.abort_request(req_id)  # frees its blocks here; not reported (see below)
            if handle is None or handle.finished_in_engine:
                continue
            # enqueue points handle.executor elsewhere, which is how the loop knows to ignore
            # the abort above when the old core reports it.
            req = resumed_request(handle, handle.produced_outputs())
            self.enqueue(handle, req, lost_kv=lost_kv)
            moved += 1
        return moved

    async def resync_store(self) -> None:
        """Rewrite every active request to Redis from memory (Redis lost acknowledged data)."""
        for handle in self.table:
            rec = handle.to_stored(self.features.stored_fields(handle))
            await self.store.create(rec, honour_abort=False)  # it runs: no abort may end it
            await self.store.rewrite_outputs(handle.req_id, handle.acked_outputs())
