"""Sending a run's requests at their scheduled times (shared by the asyncio backends)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def send_on_schedule(
    offsets: list[float], one: Callable[[int, float], Awaitable[None]]
) -> float:
    """Start `one(i, arrival)` for request i at `offsets[i]` seconds after now (arrival is
    that time on the perf_counter clock); wait for all; return the run's wall time."""
    start = time.perf_counter()
    tasks = []
    for i, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, start + offset)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - start
