"""RequestHandle.events: every acknowledged token reaches every listener, whatever the timing."""

from __future__ import annotations

import asyncio

from scheduler_svc.core.request import FinishReason
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.streams import EngineStep, RequestHandle


def _handle(n: int = 1) -> RequestHandle:
    return RequestHandle("r", [1, 2, 3], SamplingParams(n=n, max_tokens=8), 0, 0.0)


def _publish(handle: RequestHandle, index: int, tokens: list[int], finish=None) -> None:
    step = EngineStep()
    step.deltas.append((handle, index, tokens, "x" * len(tokens), None, finish, None, ""))
    step.publish()


def test_publish_while_listener_is_suspended_in_yield_is_not_lost():
    """A step that publishes while the listener's consumer is still writing the previous event
    (the generator suspended at its yield) must be seen: this lost wake-up hung a client's
    stream forever, with the request finished on the server (seen under CPU load)."""

    async def run() -> list:
        handle = _handle()
        events = handle.events(0)
        _publish(handle, 0, [10])
        first = await anext(events)  # suspended at the yield now, not parked on a waiter
        _publish(handle, 0, [11, 12], finish=FinishReason.LENGTH)
        rest = [e async for e in events]
        return [first, *rest]

    got = asyncio.run(asyncio.wait_for(run(), timeout=5))
    assert [t for e in got for t in e.token_ids] == [10, 11, 12]
    assert got[-1].finish_reason == FinishReason.LENGTH


def test_publish_to_another_sequence_during_yield_is_not_lost():
    async def run() -> list:
        handle = _handle(n=2)
        events = handle.events(0)
        _publish(handle, 0, [10])
        first = await anext(events)  # sequence 0's event; sequence 1 has nothing yet
        _publish(handle, 1, [20], finish=FinishReason.STOP)
        _publish(handle, 0, [], finish=FinishReason.STOP)
        rest = [e async for e in events]
        return [first, *rest]

    got = asyncio.run(asyncio.wait_for(run(), timeout=5))
    assert sorted((e.index, tuple(e.token_ids)) for e in got if e.token_ids) == [
        (0, (10,)),
        (1, (20,)),
    ]
    assert {e.index for e in got if e.finish_reason is not None} == {0, 1}


def test_listener_parked_between_steps_wakes_on_publish():
    async def run() -> list:
        handle = _handle()
        got = []

        async def listen():
            async for e in handle.events(0):
                got.append(e)

        task = asyncio.create_task(listen())
        await asyncio.sleep(0)  # parked on its waiter now
        for tok in (1, 2, 3):
            _publish(handle, 0, [tok])
            await asyncio.sleep(0)
        _publish(handle, 0, [], finish=FinishReason.STOP)
        await task
        return got

    got = asyncio.run(asyncio.wait_for(run(), timeout=5))
    assert [t for e in got for t in e.token_ids] == [1, 2, 3]
    assert got[-1].finish_reason == FinishReason.STOP
