"""What each API key has in the engine, and its limits: unfinished requests, and prompt tokens
of its requests that no step has started yet (what it has queued)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.core.errors import QueueFull
from scheduler_svc.engine.config import owner_of

if TYPE_CHECKING:
    from scheduler_svc.engine.streams import RequestHandle

__all__ = ["KeyUsage"]


class KeyUsage:
    def __init__(self, max_requests: int | None, max_queued_tokens: int | None) -> None:
        self.max_requests = max_requests
        self.max_queued_tokens = max_queued_tokens
        self.requests: dict[str, int] = {}
        self.queued_tokens: dict[str, int] = {}

    def check(self, owner: str, num_prompt_tokens: int) -> None:
        """RESOURCE_EXHAUSTED (QueueFull) when one more request of `owner` would pass a limit."""
        running = self.requests.get(owner, 0)
        if self.max_requests is not None and running >= self.max_requests:
            raise QueueFull(
                f"API key {owner!r} has {running} unfinished requests, its limit is "
                f"{self.max_requests}; retry when one finishes"
            )
        queued = self.queued_tokens.get(owner, 0)
        if (
            self.max_queued_tokens is not None
            and queued + num_prompt_tokens > self.max_queued_tokens
        ):
            raise QueueFull(
                f"API key {owner!r} would have {queued + num_prompt_tokens} prompt tokens queued, "
                f"its limit is {self.max_queued_tokens}"
            )

    # A request's prompt counts as queued until a step first computes it, which is when the
    # engine sets handle.scheduled_time (and calls started()).

    def admitted(self, handle: RequestHandle) -> None:
        owner = owner_of(handle.req_id)
        if not owner:
            return
        self.requests[owner] = self.requests.get(owner, 0) + 1
        self.queued_tokens[owner] = self.queued_tokens.get(owner, 0) + len(handle.prompt_token_ids)

    def started(self, handle: RequestHandle) -> None:
        owner = owner_of(handle.req_id)
        if owner in self.queued_tokens:
            self.queued_tokens[owner] -= len(handle.prompt_token_ids)

    def finished(self, handle: RequestHandle) -> None:
        owner = owner_of(handle.req_id)
        if owner not in self.requests:
            return
        if handle.scheduled_time is None:  # never started: still counted as queued
            self.queued_tokens[owner] -= len(handle.prompt_token_ids)
        self.requests[owner] -= 1
