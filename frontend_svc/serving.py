"""Running a request for an HTTP call: the scheduler's streams of every prompt merged, token
texts for logprobs, aborts when the HTTP client goes away."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from starlette.requests import Request

from client.async_client import AsyncLLMClient
from client.outputs import StreamDelta
from client.params import SamplingParams
from client.prompts import PromptInput
from frontend_svc.generation import ResilientStream, retrying

log = structlog.get_logger(__name__)

_background: set[asyncio.Task] = set()

# An id a client may choose (X-Request-Id / Idempotency-Key): printable, bounded.
MAX_ID_LEN = 200


def request_id_from(request: Request) -> str:
    rid = request.headers.get("x-request-id") or request.headers.get("idempotency-key")
    if rid and len(rid) <= MAX_ID_LEN and rid.isprintable():
        return rid
    return uuid.uuid4().hex


@dataclass
class Run:
    """One HTTP call's scheduler requests: one per prompt, ids `base` or `base-<i>`."""

    client: AsyncLLMClient
    streams: list[ResilientStream]

    @classmethod
    def start(
        cls,
        client: AsyncLLMClient,
        base_id: str,
        prompts: list[PromptInput],
        params: SamplingParams,
        *,
        priority: int,
        resume_timeout_s: float,
    ) -> Run:
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        streams = [
            ResilientStream(
                client, rid, p, params, priority=priority, resume_timeout_s=resume_timeout_s
            )
            for rid, p in zip(ids, prompts, strict=True)
        ]
        return cls(client, streams)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.streams)

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(prompt index, delta) of every stream, as they arrive; the first error is raised."""
        if len(self.streams) == 1:
            async for d in self.streams[0]:
                yield 0, d
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: ResilientStream) -> None:
            try:
                async for d in stream:
                    await queue.put((i, d))
                await queue.put((i, None))
            except BaseException as e:  # delivered to the consumer, which raises it
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def abort_in_background(self) -> None:
        """Abort every request of this call that may still run (the HTTP client went away).
        A task: this runs while the handler itself is being cancelled."""

        async def abort_all() -> None:
            for s in self.streams:
                if all(s.finished):
                    continue
                try:
                    await s.client.abort(s.request_id)
                except Exception as e:  # the scheduler may be gone; nothing else to do
                    log.warning("frontend.abort_failed", request_id=s.request_id, error=str(e))

        task = asyncio.get_running_loop().create_task(abort_all())
        _background.add(task)
        task.add_done_callback(_background.discard)


async def until_disconnect(request: Request) -> None:
    """Returns when the HTTP client has gone away (the request body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def token_texts(client: AsyncLLMClient, delta: StreamDelta) -> list[str]:
    """Each token's text, for logprob entries: from the top alternatives where the sampled
    token is among them, else asked of the scheduler."""
    texts: list[str | None] = []
    for tid, entry in zip(delta.token_ids, delta.logprobs or [], strict=False):
        lp = entry.get(tid)
        texts.append(lp.decoded_token if lp is not None and lp.decoded_token is not None else None)
    if any(t is None for t in texts) or len(texts) < len(delta.token_ids):
        _, pieces = await retrying(
            lambda: client.detokenize(delta.token_ids, skip_special_tokens=False)
        )
        return pieces
    return [t or "" for t in texts]
