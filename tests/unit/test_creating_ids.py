"""engine.aborts.CreatingIds: an abort waits for every Generate claiming its id to settle."""

from __future__ import annotations

import asyncio

from scheduler_svc.engine.aborts import CreatingIds


def test_settled_waits_for_every_claim_of_the_id():
    async def go() -> list[str]:
        creating = CreatingIds()
        events: list[str] = []
        assert await creating.settled("a") is False  # nobody claims it: no wait
        first, second = asyncio.Event(), asyncio.Event()

        async def claim(name: str, release: asyncio.Event) -> None:
            with creating.hold("a"):
                await release.wait()
                events.append(f"{name} registered")

        async def abort() -> None:
            assert await creating.settled("a") is True
            events.append("abort looks again")

        tasks = [
            asyncio.create_task(claim("first", first)),
            asyncio.create_task(claim("second", second)),  # a duplicate Generate of the id
        ]
        await asyncio.sleep(0)
        waiter = asyncio.create_task(abort())
        await asyncio.sleep(0)
        first.set()
        await asyncio.sleep(0.01)
        assert not waiter.done()  # the duplicate still claims the id
        second.set()
        await asyncio.gather(*tasks, waiter)
        assert await creating.settled("a") is False  # nothing left held
        return events

    assert asyncio.run(go()) == ["first registered", "second registered", "abort looks again"]
