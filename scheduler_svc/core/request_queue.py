"""Policy-ordered request queue (waiting, swapped) with O(1) lazy removal."""

from __future__ import annotations

import heapq

from scheduler_svc.core.request import Request


class RequestQueue:
    """Requests in policy order (a heap on sort_key) with O(1) lazy removal."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._live: dict[str, int] = {}  # req_id -> generation of its valid heap entry
        self._gen = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._live

    def push(self, req: Request) -> None:
        self._gen += 1
        self._live[req.req_id] = self._gen
        heapq.heappush(self._heap, (req.sort_key, self._gen, req))

    def peek(self) -> Request | None:
        heap = self._heap
        while heap:
            _, gen, req = heap[0]
            if self._live.get(req.req_id) == gen:
                return req
            heapq.heappop(heap)  # removed earlier
        return None

    def pop(self) -> Request:
        req = self.peek()
        assert req is not None
        heapq.heappop(self._heap)
        del self._live[req.req_id]
        return req

    def remove(self, req_id: str) -> bool:
        if self._live.pop(req_id, None) is None:
            return False
        if len(self._heap) > 2 * len(self._live) + 64:  # keep dead entries bounded
            self._heap = [e for e in self._heap if self._live.get(e[2].req_id) == e[1]]
            heapq.heapify(self._heap)
        return True

    def unordered(self) -> list[Request]:
        """The queued requests in no particular order (cheaper than `ordered`)."""
        return [e[2] for e in self._heap if self._live.get(e[2].req_id) == e[1]]

    def ordered(self) -> list[Request]:
        return [e[2] for e in sorted(self._heap) if self._live.get(e[2].req_id) == e[1]]

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()
