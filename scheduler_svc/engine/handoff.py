"""Prefill/decode disaggregation (issue 47): a request prefilled on a `--role prefill` executor
is handed over with its KV cache to a decode executor once its prefill is done and its first
token sampled, and decodes there.

New prompts go only to executors that prefill (`ExecutorPool.prompt_takers`: role prefill or
both, while one of them is up; with none up, every executor takes them). After each step of a
prefill executor its step loop calls `Handoff.run`, which moves the requests that are ready
with the live migration's machinery (`faults/migration.py`: adopt on the destination, move the
blocks past the destination's prefix-cache hits, release on the source), each to the decode
executor (role decode or both, up, not draining) the router picks. The locks are taken as
every move takes them: the movers' lock (`Migration.lock`), the source's, the destination's.

Any failure leaves the request on the prefill executor, which decodes it to the end as a
colocated executor would (the output is the same either way); it is not tried again. With no
decode executor up, requests stay where they were prefilled.
"""

from __future__ import annotations

import time

import structlog

from scheduler_svc.core.request import Request
from scheduler_svc.engine.faults.migration import Migration
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.metrics import EngineMetrics

log = structlog.get_logger(__name__)

__all__ = ["Handoff"]

_EVENTS = ("request.handing_off", "request.handoff_failed")


class Handoff:
    def __init__(self, mover: Migration, metrics: EngineMetrics) -> None:
        self.mover = mover
        self.metrics = metrics
        # Requests whose handoff failed: they finish where they are.
        self._failed: set[str] = set()

    def hands_off(self, ex: ExecutorHandle) -> bool:
        """Whether `ex` hands its prefilled requests over (a prefill-only executor taking
        work); its steps are then not planned ahead, so that one is handed over as soon as
        its first token is in."""
        return ex.role == "prefill" and ex.takes_work

    def ready(self, ex: ExecutorHandle) -> list[Request]:
        """`ex`'s requests with their prompt computed and a first token sampled, which may
        move (one sequence, nothing kept on the executor outside its blocks)."""
        out = []
        for req in ex.sched.movable_requests():
            seq = req.seqs[0]
            if (
                seq.num_output_tokens > 0
                and seq.num_computed_tokens >= seq.num_prompt_tokens
                and req.req_id not in self._failed
            ):
                out.append(req)
        return out

    async def run(self, src: ExecutorHandle) -> None:
        """Hand `src`'s ready requests to decode executors (between two of its steps)."""
        if not self.hands_off(src) or not self.ready(src):
            return
        async with self.mover.lock, src.exclusive():
            if not self.hands_off(src):
                return
            targets = [
                e for e in self.mover.pool.executors if e is not src and e.decodes and e.takes_work
            ]
            for dst, reqs in self.mover.plan(src, targets, self.ready(src)):
                await self._move(src, dst, reqs)
            self._forget_gone(src)
        src.wake.set()

    async def _move(self, src: ExecutorHandle, dst: ExecutorHandle, reqs: list[Request]) -> None:
        if not dst.takes_work:
            return
        began = time.perf_counter()
        async with dst.exclusive():
            if not (dst.takes_work and src.healthy):
                return
            locked = time.perf_counter()
            done = await self.mover.move_batch(src, dst, reqs, _EVENTS)
        dst.wake.set()
        if done is None:
            self._failed.update(r.req_id for r in reqs)
            return
        self.metrics.handed_off += done
        log.info("request.handed_off", dst=dst.address, requests=done,
                 lock_wait_s=round(locked - began, 4),
                 move_s=round(time.perf_counter() - locked, 4))  # fmt: skip

    def _forget_gone(self, src: ExecutorHandle) -> None:
        if len(self._failed) > 1024:
            held = set(src.sched.running_request_ids())
            self._failed = {r for r in self._failed if r in held}
