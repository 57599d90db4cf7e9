"""`POST /v1/responses`: OpenAI's Responses API for text in and out, on the chat path (the
chat template applied by the scheduler, the same resilient stream through scheduler restarts).

A response holds the assistant message (one `output_text` part), and before it a reasoning item
(with `--reasoning-parser`), after it one function_call item per tool call (responses_items.py).
Nothing is stored (`store` must be false), so a response cannot be fetched or continued later.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request

from client.errors import LLMServeError
from client.outputs import StreamDelta
from client.params import SamplingParams
from frontend_svc import features
from frontend_svc.auth import caller_key
from frontend_svc.chat_api import prepare
from frontend_svc.errors import APIError
from frontend_svc.protocol import ChatCompletionRequest
from frontend_svc.reasoning import ReasoningParser
from frontend_svc.responses_items import ItemStream, whole_items
from frontend_svc.responses_protocol import ResponsesRequest
from frontend_svc.serving import (
    Run,
    collect,
    request_id_from,
    request_timeout,
    start,
    stream_response,
)
from frontend_svc.state import FrontendState
from frontend_svc.tool_calling.protocol import ToolPlan

router = APIRouter()

# A sequence's finish reason -> the response's status and, when incomplete, why.
_STATUS: dict[str, tuple[str, str | None]] = {
    "stop": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "abort": ("cancelled", None),
}
# The event that ends a stream, by status. The API has no event for a cancelled response: it
# ends as an incomplete one does, with the status in the response saying which.
_LAST_EVENT = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}


@dataclass
class ResponseOutput:
    """One response as it is being generated, and the objects the API shapes of it."""

    body: ResponsesRequest
    params: SamplingParams
    run: Run
    resp_id: str
    msg_id: str
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    finish_reason: str | None = None
    finished_at: int | None = None
    plan: ToolPlan | None = None
    reasoning: ReasoningParser | None = None
    call_ids: list[str] | None = None  # a stream's ids of its calls

    def add(self, d: StreamDelta) -> None:
        self.text += d.text
        if d.finished:
            self.finish_reason = d.finish_reason
            self.finished_at = int(time.time())

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return _STATUS.get(self.finish_reason, ("failed", None))[0]

    def message(self, text: str = "", done: bool = False) -> dict[str, Any]:
        # A message has no "cancelled" or "failed": any response that did not complete holds
        # an incomplete one; one closed while the response runs on (calls follow) is complete.
        status = "completed" if self.status in ("completed", "in_progress") else "incomplete"
        return {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "status": status if done else "in_progress",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if done else [],
        }

    def items(self) -> list[dict[str, Any]]:
        base = self.msg_id.removeprefix("msg_")
        return whole_items(
            self.text,
            base,
            lambda text: self.message(text, True),
            self.reasoning,
            self.plan,
            self.call_ids,
        )

    def usage(self) -> dict[str, Any]:
        input_tokens = self.run.num_prompt_tokens
        output_tokens = sum(self.run.streams[0].forwarded)
        return {
            "input_tokens": input_tokens,
            # The scheduler does not report prefix-cache hits per request.
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        }

    def response(self) -> dict[str, Any]:
        done = self.finish_reason is not None
        status = self.status
        reason = _STATUS.get(self.finish_reason or "", (None, None))[1]
        failed = status == "failed"
        return {
            "id": self.resp_id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": self.finished_at if status == "completed" else None,
            "status": status,
            "error": {"code": "server_error", "message": "generation failed"} if failed else None,
            "incomplete_details": {"reason": reason} if reason else None,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "model": self.model,
            "output": self.items() if done else [],
            "parallel_tool_calls": self.body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "text": {"format": (self.body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": self.body.tool_choice or ("auto" if self.body.tools else "none"),
            "tools": self.body.tools or [],
            "truncation": "disabled",
            "usage": self.usage() if done else None,
            "metadata": self.body.metadata,
            "user": self.body.user,
        }


class ResponseEvents:
    """The Responses API's server-sent events, numbered in the order they are sent."""

    def __init__(self, out: ResponseOutput) -> None:
        self.out = out
        self.sequence_number = 0
        self.items = ItemStream(
            out.msg_id.removeprefix("msg_"), self.event, out.message, out.reasoning, out.plan
        )

    def event(self, type: str, **fields: Any) -> str:
        data = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"event: {type}\ndata: {payload}\n\n"

    async def of(self, _: int | None, d: StreamDelta | None) -> list[str]:
        out = self.out
        events = []
        if self.sequence_number == 0:
            # The opening events wait for the first delta, so that an error before any output
            # is still an HTTP status and not a broken stream.
            events += [
                self.event("response.created", response=out.response()),
                self.event("response.in_progress", response=out.response()),
            ]
        if d is not None:
            out.add(d)
            return events + self.items.feed(d.text, d.finished)
        events += self.items.end()
        out.call_ids = self.items.call_ids
        last = _LAST_EVENT.get(out.status, "response.completed")
        return [*events, self.event(last, response=out.response())]

    def error(self, err: APIError) -> list[str]:
        body = err.body()["error"]
        return [self.event("error", code=str(body["code"]), message=err.message, param=err.param)]


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state: FrontendState = request.app.state.frontend
    body.check_supported()
    chat = body.to_chat()
    variant, plan, params = await prepare(chat, state)
    base = request_id_from(request)
    timeout_s = request_timeout(request, body.timeout)
    run = state.start_run(base, [chat.chat(plan)], params, 0, caller_key(request), variant,
                          timeout_s=timeout_s)  # fmt: skip
    out = ResponseOutput(
        body, params, run, f"resp_{base}", f"msg_{base}", model=await state.model_name(),
        plan=plan, reasoning=state.reasoning,
    )  # fmt: skip

    if body.stream:
        events = ResponseEvents(out)
        try:
            first, rest = await start(run, request)
        except APIError as e:
            raise _named(e, plan, chat) from None
        return stream_response(run, first, rest, events.of, on_error=events.error, done="")

    async def on_delta(_: int, d: StreamDelta) -> None:
        out.add(d)

    try:
        await collect(run, request, on_delta)
    except LLMServeError as e:
        raise _named(APIError.from_llmserve(e), plan, chat) from None
    return JSONResponse(out.response())


def _named(err: APIError, plan: ToolPlan, chat: ChatCompletionRequest) -> APIError:
    """A constraint the scheduler refused, named by the Responses API's field."""
    return features.named(err, chat, plan, alias="text.format")
