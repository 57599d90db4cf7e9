"""gRPC servicer of llmserve.v1.Scheduler: converts at the edge, the engine does the work."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from protos import scheduler_pb2 as pb
from protos import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.api import convert, embed
from scheduler_svc.api.auth import bearer_token, key_name
from scheduler_svc.api.rpc_guard import Malformed, RateLimitedLog, reject_malformed
from scheduler_svc.core.errors import EngineError, NotFound, QueueFull, Unavailable, ValidationError
from scheduler_svc.engine import Engine
from scheduler_svc.engine.config import AbortOutcome, scoped_id

log = structlog.get_logger(__name__)

_STATUS = {
    ValidationError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,  # e.g. a chat prompt without a template
}


_background: set[asyncio.Task] = set()
# A bug that every request of a flood hits must not fill the disk with tracebacks either.
_internal_errors = RateLimitedLog(per_second=2.0)


async def _abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    for cls, code in _STATUS.items():
        if isinstance(exc, cls):
            await context.abort(code, str(exc))
    _internal_errors.warning("rpc.internal_error", error=repr(exc), exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, engine: Engine, api_keys: dict[str, str] | None = None) -> None:
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
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        try:
            inp = convert.generate_input_from_proto(request)
            inp.owner = self._owner(context)
            handle, created = await self.engine.submit(inp)
        except (EngineError, ValueError) as e:
            await _abort_with(context, e)
            return
        # Only the call that started the request may abort it by going away; a call that
        # attached to an existing id leaves it running.
        detached = request.detached or not created
        async for msg in self._stream(handle, 0, context, detached=detached):
            yield msg

    async def Resume(
        self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        try:
            handle = await self.engine.attach(self._req_id(context, request.request_id))
        except (EngineError, ValueError) as e:
            await _abort_with(context, e)
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

    async def _stream(self, handle, from_index: int | list[int], context, *, detached: bool):
        finished_normally = False
        try:
            async for event in handle.events(from_index):
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

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        try:
            outcome = await self.engine.abort(self._req_id(context, request.request_id))
        except (EngineError, ValueError) as e:
            await _abort_with(context, e)
            return pb.AbortResponse()
        return pb.AbortResponse(
            aborted=outcome is AbortOutcome.ABORTED, pending=outcome is AbortOutcome.PENDING
        )

    async def GetRequest(self, request: pb.GetRequestRequest, context) -> pb.GetRequestResponse:
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        try:
            view = await self.engine.get_request(self._req_id(context, request.request_id))
        except (EngineError, ValueError) as e:
            await _abort_with(context, e)
            return pb.GetRequestResponse()
        return convert.request_view_to_proto(view)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        try:
            inp = convert.tokenize_input_from_proto(request)
            ids = await self.engine.tokenize(inp)
        except (EngineError, ValueError) as e:
            await _abort_with(context, e)
            return pb.TokenizeResponse()
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self.engine.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        try:
            text, pieces = self.engine.detokenize(list(request.token_ids), skip)
        except (EngineError, ValueError) as e:
            await _abort_with(context, e)
            return pb.DetokenizeResponse()
        return pb.DetokenizeResponse(text=text, token_texts=pieces)

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        try:
            info = convert.server_info_to_proto(self.engine.server_info())
            return embed.add_embed_info(info, self.engine)  # tasks, hidden_size (api/embed.py)
        except (EngineError, ValueError) as e:
            await _abort_with(context, e)
            return pb.GetServerInfoResponse()

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        """Each input as a prompt-only pooled request (engine/embeds.py); nothing is stored."""
        if isinstance(request, Malformed):
            await reject_malformed(request, context)
        try:
            inp = embed.embed_input_from_proto(request, self._owner(context))
            result = await self.engine.embeds.embed(inp)
        except (EngineError, ValueError) as e:
            await _abort_with(context, e)
            return pb.EmbedResponse()
        return embed.embed_result_to_proto(result)
