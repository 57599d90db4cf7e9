"""The admin move (issue 47, `MoveRequest`): one running request moves with its KV cache to the
executor an operator names, with the live migration's machinery (`faults/migration.py`: adopt
on the destination, move the blocks past its prefix-cache hits, release on the source; the
movers' lock, the source's, then the destination's, as a drain or a handoff takes them).

Statuses: NOT_FOUND, no such request running on this scheduler; INVALID_ARGUMENT, no executor
of that address or instance id, one that is down or draining, or the one the request runs on;
FAILED_PRECONDITION, the request cannot move now (`movable_requests`: waiting, swapped, n > 1,
a prompt not computed yet; or no room on the destination); UNAVAILABLE, the transfer failed (the
request continues where it was, as after any failed move).
"""

from __future__ import annotations

from scheduler_svc.core.errors import NotFound, NotMovable, Unavailable, ValidationError
from scheduler_svc.core.request import Request
from scheduler_svc.engine.config import public_id
from scheduler_svc.engine.faults.migration import Migration
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.streams import RequestHandle

__all__ = ["RequestMoves"]

_EVENTS = ("request.moving", "request.move_failed")


class RequestMoves:
    def __init__(self, mover: Migration) -> None:
        self.mover = mover

    async def move(self, req_id: str, to_executor: str) -> tuple[str, str]:
        """Move `req_id` to the executor of address or instance id `to_executor`; the
        addresses it ran on and runs on now."""
        handle = self._running(req_id)
        src, dst = handle.executor, self._target(to_executor)
        if dst is src:
            raise ValidationError(f"request {public_id(req_id)!r} runs on {dst.address} already")
        async with self.mover.lock, src.exclusive():
            req = self._movable(handle, src)
            async with dst.exclusive():
                if not (dst.takes_work and src.healthy):
                    raise ValidationError(f"executor {dst.address} is not taking work")
                done = await self.mover.move_batch(src, dst, [req], _EVENTS)
            dst.wake.set()
        src.wake.set()
        if done is None:
            raise Unavailable("the KV transfer failed; the request continues where it was")
        if not done:
            raise NotMovable(f"no room for the request on {dst.address}")
        return src.address, dst.address

    def _running(self, req_id: str) -> RequestHandle:
        handle = self.mover.table.get(req_id)
        if handle is None or handle.finished_in_engine or handle.executor is None:
            raise NotFound(f"request {public_id(req_id)!r} is not running here")
        return handle

    def _target(self, to_executor: str) -> ExecutorHandle:
        for ex in self.mover.pool.executors:
            if to_executor in (ex.address, ex.describe.instance_id):
                if not ex.takes_work:
                    raise ValidationError(f"executor {to_executor!r} is not taking work")
                return ex
        raise ValidationError(f"no executor {to_executor!r} (GetServerInfo lists them)")

    def _movable(self, handle: RequestHandle, src: ExecutorHandle) -> Request:
        """The request as `src`'s core holds it, once it may move (`src`'s lock held)."""
        if handle.finished_in_engine or handle.executor is not src:
            raise NotMovable(f"request {public_id(handle.req_id)!r} moved or ended meanwhile")
        for req in src.sched.movable_requests():
            if req.req_id == handle.req_id:
                return req
        raise NotMovable(
            f"request {public_id(handle.req_id)!r} cannot move now (it must be running, "
            "with one sequence and its prompt computed, and not swapped out)"
        )
