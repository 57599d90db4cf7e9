"""Running a request for an HTTP call: the scheduler's streams of every prompt merged, token
texts for logprobs, aborts when the HTTP client goes away, and the whole or streamed (server-sent
events) HTTP answer every OpenAI route makes of it."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from client.async_client import AsyncLLMClient
from client.errors import LLMServeError
from client.outputs import StreamDelta
from client.params import SamplingParams
from client.prompts import PromptInput
from frontend_svc.errors import APIError, bad_request
from frontend_svc.generation import ResilientStream, retrying

log = structlog.get_logger(__name__)

_background: set[asyncio.Task] = set()

# An id a client may choose (X-Request-Id / Idempotency-Key): printable, bounded.
MAX_ID_LEN = 200
# The scheduler's bound on a timeout (scheduler_svc/features/deadlines/timeouts.py: a week).
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def request_id_from(request: Request) -> str:
    rid = request.headers.get("x-request-id") or request.headers.get("idempotency-key")
    if rid and len(rid) <= MAX_ID_LEN and rid.isprintable():
        return rid
    return uuid.uuid4().hex


def request_timeout(request: Request, body_timeout: float | None) -> float | None:
    """The request's deadline in seconds from arrival: the shorter of the body's `timeout` and
    the X-Request-Timeout header (None: neither; the scheduler's --request-timeout may apply)."""
    given = [_checked_timeout(body_timeout, "timeout")] if body_timeout is not None else []
    header = request.headers.get("x-request-timeout")
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            raise bad_request(
                f"X-Request-Timeout must be a number of seconds, got {header[:32]!r}",
                "X-Request-Timeout",
            ) from None
        given.append(_checked_timeout(value, "X-Request-Timeout"))
    return min(given) if given else None


def _checked_timeout(value: float, what: str) -> float:
    # The scheduler checks it too (INVALID_ARGUMENT); here the 400 can name the field.
    if not math.isfinite(value) or value <= 0 or value > MAX_TIMEOUT_S:
        raise bad_request(
            f"{what} must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {value}", what
        )
    return value


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
        fields: dict[str, Any] | None = None,
    ) -> Run:
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        streams = [
            ResilientStream(
                client,
                rid,
                p,
                params,
                priority=priority,
                resume_timeout_s=resume_timeout_s,
                fields=fields,
            )  # fmt: skip
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


class ClientGone(Exception):
    """The HTTP client disconnected before the response started (answered with 499, which
    nobody reads, as nginx logs it)."""


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _done_before_disconnect(fut: asyncio.Future, request: Request) -> bool:
    """Wait for ``fut`` or the HTTP client's disconnect, whichever comes first; False (and
    ``fut`` cancelled) when the client went away first."""
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        done, _ = await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if fut not in done:
        fut.cancel()
        return False
    return True


async def first_then_rest(it: AsyncIterator, request: Request) -> tuple[Any, AsyncIterator]:
    """The first item (so that errors before any output get a proper status, not a broken
    stream), racing the client's disconnect."""
    first = asyncio.ensure_future(anext(it))
    if not await _done_before_disconnect(first, request):
        raise ClientGone
    return first.result(), it


async def collect(run: Run, request: Request, on_delta) -> None:
    """Consume every delta (non-streaming), aborting the requests if the client goes away."""

    async def consume() -> None:
        async for i, d in run.deltas():
            await on_delta(i, d)

    work = asyncio.ensure_future(consume())
    if not await _done_before_disconnect(work, request):
        run.abort_in_background()
        raise ClientGone
    work.result()


def stream_response(
    run: Run,
    first,
    rest: AsyncIterator,
    to_events: Callable[[Any, Any], Awaitable[list[str]]],
    *,
    on_error: Callable[[APIError], list[str]] = lambda e: [sse(e.body())],
    done: str = "data: [DONE]\n\n",
) -> StreamingResponse:
    """The events `to_events(prompt index, delta)` makes of every delta, then of (None, None)
    once all are in. A scheduler error mid-stream can no longer change the HTTP status, so it
    becomes the events `on_error` makes of it; `done` ends the stream (the Responses API sends
    no `[DONE]`: its last event says so)."""

    async def body() -> AsyncIterator[str]:
        completed = False
        try:
            # One write per delta, whatever number of events it makes.
            if events := "".join(await to_events(*first)):
                yield events
            async for i, d in rest:
                if events := "".join(await to_events(i, d)):
                    yield events
            if events := "".join(await to_events(None, None)):
                yield events
            completed = True
        except LLMServeError as e:
            yield "".join(on_error(APIError.from_llmserve(e)))
            completed = True
        finally:
            if not completed:
                run.abort_in_background()  # the client went away mid-stream
        if done:
            yield done

    return StreamingResponse(body(), media_type="text/event-stream")


async def start(run: Run, request: Request):
    """The first delta of a run and an iterator of the rest; errors before any output are
    raised as APIError."""
    it = run.deltas()
    try:
        return await first_then_rest(it, request)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    except ClientGone:
        run.abort_in_background()
        raise


class Answer(Protocol):
    """One generation call's answer being built (completions_api, chat_api)."""

    run: Run

    async def events(self, i: Any, d: Any) -> list[str]: ...

    async def add(self, i: int, d: StreamDelta) -> None: ...

    def error(self, e: LLMServeError | APIError) -> APIError: ...

    def whole(self) -> dict: ...


async def respond(answer: Answer, stream: bool, request: Request) -> Any:
    """The HTTP response of a generation call: its events streamed, or one JSON body once every
    delta is in; an error before any output gets its status, in the answer's wording."""
    if stream:
        try:
            first, rest = await start(answer.run, request)
        except APIError as e:
            raise answer.error(e) from None
        return stream_response(answer.run, first, rest, answer.events)
    try:
        await collect(answer.run, request, answer.add)
    except LLMServeError as e:
        raise answer.error(e) from None
    return JSONResponse(answer.whole())


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
