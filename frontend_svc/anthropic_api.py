"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API on the chat
path (anthropic_protocol.py turns the body into a chat request), so a conversation gives the
same tokens here as on /v1/chat/completions, tool calls read by the same parsers.

An answer is a list of content blocks: the reasoning as a `thinking` block (with
`--reasoning-parser`), the text as a `text` block, each tool call as a `tool_use` block.
Streamed, the events are Anthropic's: message_start, ping, then per block content_block_start,
its deltas and content_block_stop, then message_delta (stop_reason, usage) and message_stop.
Errors are in Anthropic's shape (errors.py), before the stream as an HTTP status, during it as
an `error` event.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request

from client.errors import LLMServeError
from client.outputs import StreamDelta
from client.prompts import ChatPrompt
from frontend_svc.anthropic_protocol import CountTokensRequest, MessagesRequest
from frontend_svc.auth import caller_key
from frontend_svc.chat_api import prepare
from frontend_svc.errors import APIError
from frontend_svc.generation import retrying
from frontend_svc.protocol import ChatCompletionRequest
from frontend_svc.reasoning import ReasoningStream
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
from frontend_svc.tool_calling.stream import ToolCallStream, extract

router = APIRouter()


def _event(kind: str, **data: Any) -> str:
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n"


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (tool_calling/stream.py) as a tool_use block."""
    f = call["function"]
    try:
        arguments = json.loads(f["arguments"] or "{}")
    except ValueError:
        arguments = {}  # the parsers report only calls whose arguments parse; cannot happen
    return {"type": "tool_use", "id": _tool_id(call["id"]), "name": f["name"], "input": arguments}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessageAnswer:
    """One /v1/messages call: its run, and the message it makes whole or as events."""

    def __init__(
        self, body: MessagesRequest, chat: ChatCompletionRequest, state: FrontendState, run: Run
    ) -> None:
        self.body, self.chat, self.state, self.run = body, chat, state, run
        self.plan: ToolPlan | None = None
        self.msg_id = f"msg_{run.streams[0].request_id}"
        self.text = ""
        self.finish: tuple[str | None, Any] = (None, None)
        # Streaming state: the open block (index, type), and the readers of the text.
        self.sent_start = False
        self.block: tuple[int, str] | None = None
        self.num_blocks = 0
        self.num_calls = 0
        self.thinker = ReasoningStream(state.reasoning) if state.reasoning else None
        self.reader: ToolCallStream | None = None

    @classmethod
    async def begin(cls, body: MessagesRequest, request: Request) -> MessageAnswer:
        state: FrontendState = request.app.state.frontend
        chat = body.to_chat()
        variant, plan, params = await prepare(chat, state)
        run = state.start_run(
            request_id_from(request), [chat.chat(plan)], params, 0, caller_key(request), variant,
            timeout_s=request_timeout(request, body.timeout),
        )  # fmt: skip
        answer = cls(body, chat, state, run)
        answer.plan = plan
        if plan.parser is not None:
            answer.reader = ToolCallStream(plan.parser, plan.max_calls)
        return answer

    def _stop(self, num_calls: int) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence of the finished sequence."""
        reason, stop = self.finish
        if reason == "length":
            return "max_tokens", None
        if num_calls and reason == "stop":
            return "tool_use", None
        if isinstance(stop, str) and stop in (self.body.stop_sequences or []):
            return "stop_sequence", stop
        return "end_turn", None

    def _usage(self) -> dict[str, int]:
        return {
            "input_tokens": self.run.num_prompt_tokens,
            "output_tokens": sum(self.run.streams[0].forwarded),
        }

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, Any]) -> dict:
        return {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.body.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self._usage(),
        }

    async def add(self, _: int, d: StreamDelta) -> None:
        self.text += d.text
        if d.finished:
            self.finish = (d.finish_reason, d.stop_reason)

    def whole(self) -> dict:
        text, blocks = self.text, []
        if self.state.reasoning is not None:
            reasoning, text = self.state.reasoning.split(text)
            if reasoning:
                blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        calls = []
        if self.plan is not None and self.plan.parser is not None:
            found = extract(self.plan.parser, text, self.plan.max_calls)
            text, calls = found.content or "", found.tool_calls
        if text:
            blocks.append({"type": "text", "text": text})
        blocks += [_tool_use(c) for c in calls]
        return self.message(blocks, self._stop(len(calls)))

    # Streaming.

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.block = (self.num_blocks, kind)
        self.num_blocks += 1
        return [*out, _event("content_block_start", index=self.block[0], content_block=block)]

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        index, self.block = self.block[0], None
        return [_event("content_block_stop", index=index)]

    def _delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        """A delta of a block of `kind`, opening one (`block`) unless that kind is open."""
        out = self._open(kind, block) if self.block is None or self.block[1] != kind else []
        return [*out, _event("content_block_delta", index=self.block[0], delta=delta)]

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        return self._delta(
            "text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text}
        )

    def _calls(self, calls: list[dict[str, Any]]) -> list[str]:
        out = []
        for c in calls:
            if "id" in c:  # a new call: its block opens with the name, arguments follow
                self.num_calls += 1
                block = {**_tool_use(c), "input": {}}
                out += self._open(f"tool_use:{self.num_calls}", block)
            elif args := c["function"].get("arguments"):
                delta = {"type": "input_json_delta", "partial_json": args}
                out.append(_event("content_block_delta", index=self.block[0], delta=delta))
        return out

    async def events(self, _: int | None, d: StreamDelta | None) -> list[str]:
        out = []
        if not self.sent_start:
            self.sent_start = True
            start_msg = self.message([], (None, None))
            out += [_event("message_start", message=start_msg), _event("ping")]
        if d is None:
            stop = self._stop(self.num_calls)
            delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
            usage = {"output_tokens": self._usage()["output_tokens"]}
            return [
                *out,
                *self._close(),
                _event("message_delta", delta=delta, usage=usage),
                _event("message_stop"),
            ]
        if d.finished:
            self.finish = (d.finish_reason, d.stop_reason)
        reasoning, text = "", d.text
        if self.thinker is not None:
            reasoning, text = self.thinker.feed(d.text)
            if d.finished:
                more = self.thinker.finish()
                reasoning, text = reasoning + more[0], text + more[1]
        if reasoning:
            block = {"type": "thinking", "thinking": "", "signature": ""}
            out += self._delta("thinking", block, {"type": "thinking_delta", "thinking": reasoning})
        if self.reader is None:
            return out + self._text(text)
        content, calls = self.reader.feed(text)
        if d.finished:
            more_content, more_calls = self.reader.finish()
            content, calls = content + more_content, calls + more_calls
        return out + self._text(content) + self._calls(calls)

    def error(self, err: APIError) -> list[str]:
        return [_event("error", error=err.anthropic_body()["error"])]


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    answer = await MessageAnswer.begin(body, request)
    if body.stream:
        first, rest = await start(answer.run, request)
        return stream_response(
            answer.run, first, rest, answer.events, on_error=answer.error, done=""
        )
    try:
        await collect(answer.run, request, answer.add)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    return JSONResponse(answer.whole())


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    """The prompt's tokens as /v1/messages would count them (its usage.input_tokens)."""
    state: FrontendState = request.app.state.frontend
    await state.check_model(body.model)
    tools = [t.model_dump(exclude_none=True) for t in body.chat_tools().get("tools", [])]
    messages = [m.to_dict() for m in body.chat_messages()]
    prompt = ChatPrompt(messages, True, tools=tools or None)
    client = state.client_for(caller_key(request))
    try:
        ids, _ = await retrying(lambda: client.tokenize(prompt))
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    return {"input_tokens": len(ids)}
