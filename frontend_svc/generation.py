"""One request's output stream, as the frontend forwards it: exactly once, through scheduler
restarts.

The scheduler keeps every acknowledged token in Redis, so when its process dies mid-stream
the request is not lost: `ResilientStream` re-attaches with `Resume` from the first token of
each sequence it has not forwarded yet (one index per sequence), retrying while the scheduler
is away, so its caller sees one uninterrupted stream. A request the scheduler never stored
(it died before accepting it) is submitted again under the same id, which is idempotent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

from client.async_client import AsyncLLMClient
from client.errors import LLMServeError
from client.outputs import StreamDelta
from client.params import SamplingParams
from client.prompts import PromptInput

log = structlog.get_logger(__name__)
T = TypeVar("T")

# Statuses after which the stream is retried: the scheduler went away or is starting.
_RETRY = {grpc.StatusCode.UNAVAILABLE}
# A stream whose connection the transport cut mid-response (the scheduler killed while it was
# sending) can also surface as UNKNOWN or INTERNAL with the transport's own words rather than
# UNAVAILABLE: it is retried too. Any other UNKNOWN is the server's answer and is not.
_CUT_MARKERS = ("Stream removed", "Connection reset", "Socket closed", "RST_STREAM")


def retryable(err: LLMServeError) -> bool:
    """Whether a failed stream should be resumed: the scheduler is away, or its connection was
    cut mid-stream."""
    if err.code in _RETRY:
        return True
    return err.code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and any(
        m in err.message for m in _CUT_MARKERS
    )


async def retrying(call: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
    """``await call()``, again while it fails as a stream would be resumed (``retryable``), for
    up to ``timeout_s``: for the idempotent unary calls made mid-stream (detokenizing logprob
    tokens), which a scheduler restart must not turn into an error either."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        try:
            return await call()
        except LLMServeError as err:
            if not retryable(err) or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


class ResilientStream:
    def __init__(
        self,
        client: AsyncLLMClient,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        priority: int = 0,
        resume_timeout_s: float = 60.0,
        fields: dict[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.fields = fields or {}  # the features' request fields (model_variants.py)
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.priority = priority
        self.resume_timeout_s = resume_timeout_s
        self.forwarded = [0] * params.n  # tokens forwarded per sequence
        self.finished = [False] * params.n
        self.num_prompt_tokens = 0
        self.num_resumes = 0

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        started = False  # the scheduler has acknowledged the request (sent anything)
        outage_since: float | None = None
        delay = 0.05
        while not all(self.finished):
            if started:
                source = self.client.resume(self.request_id, list(self.forwarded))
            else:
                # detached: this frontend aborts explicitly when its HTTP client goes away, and
                # a call cut by a scheduler crash must not abort what it will resume.
                source = self.client.stream(
                    self.prompt,
                    self.params,
                    request_id=self.request_id,
                    priority=self.priority,
                    detached=True,
                    **self.fields,
                )
            try:
                async for delta in source:
                    started = True
                    outage_since = None
                    delay = 0.05
                    i = delta.index
                    if self.finished[i]:
                        continue  # its finish was forwarded before the outage
                    self.num_prompt_tokens = delta.num_prompt_tokens
                    self.forwarded[i] = delta.token_offset + len(delta.token_ids)
                    if delta.finished:
                        self.finished[i] = True
                    if delta.finish_reason == "deadline":
                        # Cut short by its deadline: to OpenAI's and Anthropic's clients that
                        # is a truncated output, "length" ("max_tokens"); docs/openai.md.
                        delta.finish_reason = "length"
                    yield delta
                if not all(self.finished):
                    raise LLMServeError(grpc.StatusCode.UNAVAILABLE, "stream ended early")
            except LLMServeError as err:
                if not retryable(err):
                    raise
                now = time.monotonic()
                if outage_since is None:
                    outage_since = now
                    log.warning(
                        "frontend.stream_interrupted", request_id=self.request_id, error=err.message
                    )
                if now - outage_since > self.resume_timeout_s:
                    raise
                self.num_resumes += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
