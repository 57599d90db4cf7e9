"""Garbage in, a clean status out: malformed request bytes get INVALID_ARGUMENT on any RPC.

grpc.aio deserialises a request before any servicer code runs, and a `DecodeError` there
becomes UNKNOWN plus a traceback in the log, per message. `MalformedRequestGuard` swaps every
method's deserialiser for one that returns a `Malformed` marker instead of raising. The public
servicer checks for the marker itself at the top of each method (cheap, and its streams keep
no extra layer per message); the standard services served beside it (health, reflection) get
their behaviour wrapped here. Rejections are logged through a rate limit, so that a flood of
garbage cannot fill the disk.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

__all__ = ["Malformed", "MalformedRequestGuard", "RateLimitedLog", "reject_malformed"]


class Malformed:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("method", "error")

    def __init__(self, method: str, error: Exception) -> None:
        self.method = method
        self.error = error


class RateLimitedLog:
    """At most `per_second` lines a second (bursts up to that many); the count of what was
    left out goes with the next line that is written."""

    def __init__(self, per_second: float = 10.0) -> None:
        self.per_second = per_second
        self._tokens = per_second
        self._last = time.monotonic()
        self._suppressed = 0

    def warning(self, event: str, **fields: Any) -> bool:
        now = time.monotonic()
        self._tokens = min(self.per_second, self._tokens + (now - self._last) * self.per_second)
        self._last = now
        if self._tokens < 1.0:
            self._suppressed += 1
            return False
        self._tokens -= 1.0
        if self._suppressed:
            fields["num_suppressed"] = self._suppressed
            self._suppressed = 0
        log.warning(event, **fields)
        return True


bad_requests = RateLimitedLog()


async def reject_malformed(request: Malformed, context: grpc.aio.ServicerContext) -> None:
    """Abort the call with INVALID_ARGUMENT (raises, as context.abort does)."""
    bad_requests.warning("rpc.malformed_request", method=request.method, error=str(request.error))
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid protobuf message for {request.method}",
    )


def _safe_deserializer(method: str, deserialize: Callable[[bytes], Any]) -> Callable:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, and whatever else garbage makes a parser raise
            return Malformed(method, e)

    return parse


def _checked_unary(behaviour: Callable) -> Callable:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        return await behaviour(request, context)

    return handle


def _checked_stream(behaviour: Callable) -> Callable:
    async def checked(requests: AsyncIterator, context: grpc.aio.ServicerContext):
        async for request in requests:
            if isinstance(request, Malformed):
                await reject_malformed(request, context)
            yield request

    if inspect.isasyncgenfunction(behaviour):

        async def handle_gen(requests: AsyncIterator, context: grpc.aio.ServicerContext):
            async for response in behaviour(checked(requests, context), context):
                yield response

        return handle_gen

    async def handle(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(checked(requests, context), context)

    return handle


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    """Installs the safe deserialiser on every method; `self_checked` names the services whose
    servicers test for `Malformed` themselves (their behaviour is left as it is)."""

    def __init__(self, self_checked: frozenset[str] = frozenset()) -> None:
        self.self_checked = self_checked
        self._cache: dict[str, grpc.RpcMethodHandler | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method
        if method in self._cache:
            return self._cache[method]
        handler = await continuation(details)
        guarded = self._guard(method, handler) if handler is not None else None
        if guarded is not None or handler is None:
            self._cache[method] = guarded  # handlers are per method, not per call
        return guarded

    def _guard(self, method: str, handler: Any) -> Any:
        if handler.request_deserializer is None:
            return handler
        changes: dict[str, Any] = {
            "request_deserializer": _safe_deserializer(method, handler.request_deserializer)
        }
        if method.lstrip("/").split("/")[0] not in self.self_checked:
            for kind in ("unary_unary", "unary_stream"):
                if getattr(handler, kind) is not None:
                    behaviour = getattr(handler, kind)
                    if not inspect.iscoroutinefunction(behaviour):
                        return handler  # sync behaviours are not served by this server
                    changes[kind] = _checked_unary(behaviour)
            for kind in ("stream_unary", "stream_stream"):
                if getattr(handler, kind) is not None:
                    changes[kind] = _checked_stream(getattr(handler, kind))
        return handler._replace(**changes)
