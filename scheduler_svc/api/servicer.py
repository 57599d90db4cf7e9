"""gRPC servicer of llmserve.v1.Scheduler: converts at the edge, the engine does the work.

It talks to the engine through `EngineClient` only. Every RPC goes through `_rpc`: a request
whose bytes did not parse gets INVALID_ARGUMENT, and an engine error the status that says what
the caller can do about it (`_STATUS`); the streams are opened through it the same way and then
run without an extra layer per message. The RPCs an optional feature serves (`Feature.rpcs`)
are methods added per `feature_rpcs()`, each handing the call to its feature's `serve`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc
from scheduler_svc import tracing
from scheduler_svc.api import convert
from scheduler_svc.api.auth import bearer_token, key_name
from scheduler_svc.api.rpc_guard import Malformed, RateLimitedLog, reject_malformed
from scheduler_svc.core.errors import (
    EngineError,
    NotFound,
    NotMovable,
    QueueFull,
    Unavailable,
    ValidationError,
)
from scheduler_svc.core.request import FinishReason
from scheduler_svc.engine.client import EngineClient
from scheduler_svc.engine.config import AbortOutcome, public_id, scoped_id
from scheduler_svc.engine.streams import EngineEvent, RequestHandle
from scheduler_svc.features.base import RpcCall
from scheduler_svc.features.registry import feature_rpcs

log = structlog.get_logger(__name__)

_STATUS = {
    ValidationError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    NotMovable: grpc.StatusCode.FAILED_PRECONDITION,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,  # e.g. a chat prompt without a template
}


_background: set[asyncio.Task] = set()
# A bug that every request of a flood hits must not fill the disk with tracebacks either.
_internal_errors = RateLimitedLog(per_second=2.0)

T = TypeVar("T")
Method = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]


async def _abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    for cls, code in _STATUS.items():
        if isinstance(exc, cls):
            await context.abort(code, str(exc))
    _internal_errors.warning("rpc.internal_error", error=repr(exc), exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def _rpc(empty: Callable[[], T | None]) -> Callable[[Method[T]], Method[T | None]]:
    """Malformed bytes and engine errors become statuses (context.abort raises); `empty` is
    what a handler returns should the abort not raise."""

    def wrap(method: Method[T]) -> Method[T | None]:
        @functools.wraps(method)
        async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T | None:
            if isinstance(request, Malformed):
                await reject_malformed(request, context)
            try:
                return await method(self, request, context)
            except (EngineError, ValueError) as e:
                await _abort_with(context, e)
                return empty()

        return handler

    return wrap


def _deadline_before_output(event: EngineEvent) -> bool:
    """A sequence ended by its deadline with no token: the call ends DEADLINE_EXCEEDED (a
    request that got further finishes normally, FINISH_REASON_DEADLINE)."""
    return (
        event.finish_reason == FinishReason.DEADLINE
        and not event.token_offset
        and not event.token_ids
    )


def _nothing() -> None:
    return None


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, engine: EngineClient, api_keys: dict[str, str] | None = None) -> None:
        """`api_keys` ({key: name}): requests belong to the key that created them (the
        ApiKeyInterceptor has already refused calls without a valid key)."""
        self.engine = engine
        self.api_keys = api_keys or {}

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        if not self.api_keys:
            return ""
        token = next(
            (
                bearer_token(v)
                for k, v in context.invocation_metadata() or ()
                if k == "authorization"
            ),
            "",
        )
        return key_name(self.api_keys, token) or ""

    def _req_id(self, context: grpc.aio.ServicerContext, given: str) -> str:
        return scoped_id(self._owner(context), given)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        opened = await self._submit(request, context)
        if opened is None:
            return
        handle, created = opened
        # Only the call that started the request may abort it by going away; a call that
        # attached to an existing id leaves it running.
        detached = request.detached or not created
        async for msg in self._stream(handle, 0, context, detached=detached):
            yield msg

    @_rpc(_nothing)
    async def _submit(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[RequestHandle, bool]:
        inp = convert.generate_input_from_proto(request)
        inp.features = self.engine.request_features(request)
        inp.owner = self._owner(context)
        remaining = context.time_remaining()
        if remaining is not None and not request.detached:
            # The call's own deadline ends the call anyway (and so, attached, the request):
            # as a request deadline it ends cleanly, and is stored (features/deadlines).
            inp.timeouts += (max(0.0, remaining),)
        inp.trace_parent = tracing.incoming(context.invocation_metadata())
        return await self.engine.submit(inp)

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        handle = await self._attach(request, context)
        if handle is None:
            return
        start: int | list[int] = request.from_token_index
        if request.from_token_indices:
            if len(request.from_token_indices) != handle.n:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"from_token_indices has {len(request.from_token_indices)} entries; "
                    f"the request has {handle.n} sequences",
                )
            start = list(request.from_token_indices)
        # A resumed stream never aborts the request when the client goes away again.
        async for msg in self._stream(handle, start, context, detached=True):
            yield msg

    @_rpc(_nothing)
    async def _attach(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> RequestHandle:
        span = tracing.rpc_span("llmserve.resume", context.invocation_metadata(),
                                **{"llmserve.req_id": request.request_id})  # fmt: skip
        try:
            return await self.engine.attach(self._req_id(context, request.request_id))
        finally:
            tracing.end(span)

    async def _stream(
        self,
        handle: RequestHandle,
        from_index: int | list[int],
        context: grpc.aio.ServicerContext,
        *,
        detached: bool,
    ) -> AsyncIterator[pb.GenerateResponse]:
        finished_normally = False
        try:
            async for event in handle.events(from_index):
                if _deadline_before_output(event):
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"request {public_id(handle.req_id)!r} passed its deadline before it "
                        "produced a token",
                    )
                yield convert.event_to_proto(handle, event)
            finished_normally = True
        except EngineError as e:
            await _abort_with(context, e)
        finally:
            if not finished_normally and not detached:
                # The call was cancelled (client gone): abort unless asked to keep it running.
                # A task, not an await: this runs while the handler itself is being cancelled.
                task = asyncio.get_running_loop().create_task(
                    self.engine.abort(handle.req_id, missing_ok=True)
                )
                _background.add(task)
                task.add_done_callback(_background.discard)

    @_rpc(pb.AbortResponse)
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        outcome = await self.engine.abort(self._req_id(context, request.request_id))
        return pb.AbortResponse(
            aborted=outcome is AbortOutcome.ABORTED, pending=outcome is AbortOutcome.PENDING
        )

    @_rpc(pb.GetRequestResponse)
    async def GetRequest(
        self, request: pb.GetRequestRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetRequestResponse:
        view = await self.engine.get_request(self._req_id(context, request.request_id))
        return convert.request_view_to_proto(view)

    @_rpc(pb.TokenizeResponse)
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        ids = await self.engine.tokenize(convert.tokenize_input_from_proto(request))
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.engine.max_model_len)

    @_rpc(pb.DetokenizeResponse)
    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text, pieces = self.engine.detokenize(list(request.token_ids), skip)
        return pb.DetokenizeResponse(text=text, token_texts=pieces)

    @_rpc(pb.GetServerInfoResponse)
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        return convert.server_info_to_proto(self.engine.server_info())

    @_rpc(pb.MoveRequestResponse)
    async def MoveRequest(
        self, request: pb.MoveRequestRequest, context: grpc.aio.ServicerContext
    ) -> pb.MoveRequestResponse:
        req_id = self._req_id(context, request.request_id)
        src, dst = await self.engine.move_request(req_id, request.to_executor)
        return pb.MoveRequestResponse(from_executor=src, to_executor=dst)


def _feature_rpc(method: str, feature: str) -> Method[Any]:
    """A servicer method for a public RPC a feature serves (``Feature.rpcs``): through `_rpc`
    like every other (malformed bytes, engine errors), answered by the feature's ``serve``."""
    response = getattr(pb, _SERVICE.methods_by_name[method].output_type.name)

    async def handler(self: SchedulerServicer, request: Any, context: Any) -> Any:
        call = RpcCall(self._owner(context), context.invocation_metadata())
        return await self.engine.feature(feature).serve(method, request, call)

    handler.__name__ = handler.__qualname__ = method
    return _rpc(response)(handler)


_SERVICE = pb.DESCRIPTOR.services_by_name["Scheduler"]
for _method, _feature in feature_rpcs().items():
    setattr(SchedulerServicer, _method, _feature_rpc(_method, _feature))
