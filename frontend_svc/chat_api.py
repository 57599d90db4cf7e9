"""`POST /v1/chat/completions`: one call's answer as an object that owns its choices (texts,
logprobs, finishes), fed the run's deltas and shaped as stream chunks or one body. The chat
template is applied by the scheduler. With tools, each choice's text is read as content and
tool calls by the call's parser (tool_calling/stream.py): whole at the end, or delta by delta. With
`--reasoning-parser`, the reasoning is split off first (reasoning.py) and the rest is the
answer that content, tool calls and the features' constraints apply to."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request

from client.errors import LLMServeError
from client.outputs import StreamDelta
from client.params import SamplingParams
from frontend_svc import features
from frontend_svc.auth import caller_key
from frontend_svc.errors import APIError
from frontend_svc.logprobs import chat_logprobs, usage
from frontend_svc.protocol import ChatCompletionRequest
from frontend_svc.reasoning import ReasoningStream
from frontend_svc.serving import Run, request_id_from, request_timeout, respond, sse
from frontend_svc.serving import token_texts as _token_texts
from frontend_svc.state import FrontendState
from frontend_svc.tool_calling.protocol import ToolPlan
from frontend_svc.tool_calling.stream import ToolCallStream, extract

router = APIRouter()


async def prepare(
    body: ChatCompletionRequest, state: FrontendState
) -> tuple[str, ToolPlan, SamplingParams]:
    """A chat call's model variant (check_model's answer: "" or an adapter's name), tool plan and
    sampling parameters (also the Messages API's, which runs as a chat call)."""
    variant = await state.check_model(body.model)
    plan = body.plan(state.tool_config)
    params = body.to_params(await state.max_model_len(), plan)
    await features.fit(params, plan, state)
    return variant, plan, params


class ChatAnswer:
    """What one /v1/chat/completions call has produced so far (n choices of one prompt)."""

    def __init__(
        self,
        body: ChatCompletionRequest,
        state: FrontendState,
        run: Run,
        n: int,
        model: str,
        request_id: str,
        plan: ToolPlan,
    ) -> None:
        self.body, self.state, self.run, self.n, self.model = body, state, run, n, model
        self.plan = plan
        self.reasoning = state.reasoning
        # Streamed choices' reasoning splitters (with --reasoning-parser only).
        self.thinkers = (
            {j: ReasoningStream(self.reasoning) for j in range(n)} if self.reasoning else {}
        )
        # Streamed choices' tool-call readers (tool modes with a parser only).
        self.readers = (
            {j: ToolCallStream(plan.parser, plan.max_calls) for j in range(n)}
            if plan.parser
            else {}
        )
        self.rid, self.created = f"chatcmpl-{request_id}", int(time.time())
        self.greeted: set[int] = set()  # streamed choices whose role chunk went out
        self.texts = {j: "" for j in range(n)}
        self.lps: dict[int, list] = {j: [] for j in range(n)}
        self.finish: dict[int, tuple] = {}
        self.extra = features.response_fields()  # the features' fields of the whole body

    @classmethod
    async def begin(cls, body: ChatCompletionRequest, request: Request) -> ChatAnswer:
        state: FrontendState = request.app.state.frontend
        variant, plan, params = await prepare(body, state)
        base = request_id_from(request)
        run = state.start_run(
            base, [body.chat(plan)], params, body.priority, caller_key(request), variant,
            timeout_s=request_timeout(request, body.timeout),
        )  # fmt: skip
        return cls(body, state, run, params.n, variant or await state.model_name(), base, plan)

    def error(self, e: LLMServeError | APIError) -> APIError:
        err = e if isinstance(e, APIError) else APIError.from_llmserve(e)
        return features.named(err, self.body, self.plan)

    def _finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        # As OpenAI: a call the model chose to make ends the turn as "tool_calls"; one forced
        # by a named tool_choice ends as "stop".
        if num_calls and reason == "stop" and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    async def _logprobs(self, d: StreamDelta) -> list | None:
        if not self.body.logprobs or not d.token_ids:
            return None
        return chat_logprobs(d, await _token_texts(self.state.client, d))

    def _usage(self) -> dict:
        return usage(self.run.num_prompt_tokens, sum(self.run.streams[0].forwarded))

    def _chunk(self, choices: list, **extra: Any) -> str:
        if self.body.continuous_usage and "usage" not in extra:
            extra["usage"] = self._usage()  # what the stream has counted so far (as vLLM)
        return sse(
            {
                "id": self.rid,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": self.state.fingerprint,
                "choices": choices,
                **extra,
            }
        )

    def _choice_chunk(self, d: StreamDelta, delta: dict, logprobs: Any = None, **end: Any) -> str:
        choice = {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return self._chunk([{**choice, **end}])

    async def events(self, i: int | None, d: StreamDelta | None) -> list[str]:
        """The stream chunks of one delta: the role first for a new choice, then its text
        (with logprobs), then its finish; of (None, None) the closing usage chunk."""
        if d is None:
            return [self._chunk([], usage=self._usage())] if self.body.include_usage else []
        out = []
        if d.index not in self.greeted:
            self.greeted.add(d.index)
            out.append(self._choice_chunk(d, {"role": "assistant", "content": ""}))
        lp = await self._logprobs(d)
        content = {"content": lp} if lp is not None else None
        reasoning, text = self._split(d)
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        reader = self.readers.get(d.index)
        if reader is None:
            if text or (lp and not deltas):
                deltas.append({"content": text})
            num_calls = 0
        else:
            deltas += self._tool_deltas(text, d.finished, reader)
            num_calls = reader.num_calls
        if not deltas and lp is not None:
            deltas = [{}]
        # The delta's logprobs ride on its first chunk.
        out += [
            self._choice_chunk(d, delta, content if k == 0 else None)
            for k, delta in enumerate(deltas)
        ]
        if d.finished:
            reason = self._finish_reason(d.finish_reason, num_calls)
            end = {"finish_reason": reason, "stop_reason": d.stop_reason}
            out.append(self._choice_chunk(d, {}, **end))
        return out

    def _split(self, d: StreamDelta) -> tuple[str, str]:
        """A streamed delta's (reasoning, answer) text: all answer without a reasoning parser."""
        thinker = self.thinkers.get(d.index)
        if thinker is None:
            return "", d.text
        reasoning, text = thinker.feed(d.text)
        if d.finished:
            more_reasoning, more_text = thinker.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        return reasoning, text

    @staticmethod
    def _tool_deltas(text: str, finished: bool, reader: ToolCallStream) -> list[dict]:
        """Answer text as content and tool-call deltas."""
        content, calls = reader.feed(text)
        if finished:
            more_content, more_calls = reader.finish()
            content, calls = content + more_content, calls + more_calls
        return ([{"content": content}] if content else []) + [{"tool_calls": [c]} for c in calls]

    async def add(self, i: int, d: StreamDelta) -> None:
        """Fold one delta into the whole answer (non-streaming)."""
        for field in self.extra:
            field.add(d)
        self.texts[d.index] += d.text
        lp = await self._logprobs(d)
        if lp:
            self.lps[d.index].extend(lp)
        if d.finished:
            self.finish[d.index] = (d.finish_reason, d.stop_reason)

    def whole(self) -> dict:
        """The non-streaming body, once every delta is in."""
        choices = []
        for j in range(self.n):
            text = self.texts[j]
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.reasoning is not None:
                message["reasoning_content"], text = self.reasoning.split(text)
                message["content"] = text
            if self.plan.parser is not None:
                found = extract(self.plan.parser, text, self.plan.max_calls)
                message["content"] = found.content
                if found.tool_calls:
                    message["tool_calls"] = found.tool_calls
            reason, stop_reason = self.finish.get(j, (None, None))
            choices.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": {"content": self.lps[j]} if self.body.logprobs else None,
                    "finish_reason": self._finish_reason(
                        reason, len(message.get("tool_calls", []))
                    ),
                    "stop_reason": stop_reason,
                }
            )
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
            "system_fingerprint": self.state.fingerprint,
        }
        for field in self.extra:
            out.update(field.fields())
        return out


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await respond(await ChatAnswer.begin(body, request), body.stream, request)
