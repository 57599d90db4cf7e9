"""`POST /v1/chat/completions`: one call's answer as an object that owns its choices (texts,
logprobs, finishes), fed the run's deltas and shaped as stream chunks or one body. The chat
template is applied by the scheduler."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request

from client.errors import LLMServeError
from client.outputs import StreamDelta
from client.prompts import ChatPrompt
from frontend_svc.auth import caller_key
from frontend_svc.errors import APIError
from frontend_svc.protocol import ChatCompletionRequest
from frontend_svc.responses import chat_logprobs, prompt_logprobs, usage
from frontend_svc.serving import Run, collect, request_id_from, sse, start, stream_response
from frontend_svc.serving import token_texts as _token_texts
from frontend_svc.state import FrontendState

router = APIRouter()


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
    ) -> None:
        self.body, self.state, self.run, self.n, self.model = body, state, run, n, model
        self.rid, self.created = f"chatcmpl-{request_id}", int(time.time())
        self.greeted: set[int] = set()  # streamed choices whose role chunk went out
        self.texts = {j: "" for j in range(n)}
        self.lps: dict[int, list] = {j: [] for j in range(n)}
        self.finish: dict[int, tuple] = {}
        self.prompt_lps: list | None = None

    @classmethod
    async def begin(cls, body: ChatCompletionRequest, request: Request) -> ChatAnswer:
        state: FrontendState = request.app.state.frontend
        await state.check_model(body.model)
        params = body.to_params(await state.max_model_len())
        chat = body.chat()
        prompt = ChatPrompt(chat["messages"], chat["add_generation_prompt"])
        base = request_id_from(request)
        run = state.start_run(base, [prompt], params, body.priority, caller_key(request))
        return cls(body, state, run, params.n, await state.model_name(), base)

    async def _logprobs(self, d: StreamDelta) -> list | None:
        if not self.body.logprobs or not d.token_ids:
            return None
        return chat_logprobs(d, await _token_texts(self.state.client, d))

    def _usage(self) -> dict:
        return usage(self.run.num_prompt_tokens, sum(self.run.streams[0].forwarded))

    def _chunk(self, choices: list, **extra: Any) -> str:
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
        if d.text or lp:
            content = {"content": lp} if lp is not None else None
            out.append(self._choice_chunk(d, {"content": d.text}, content))
        if d.finished:
            end = {"finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
            out.append(self._choice_chunk(d, {}, **end))
        return out

    async def add(self, i: int, d: StreamDelta) -> None:
        """Fold one delta into the whole answer (non-streaming)."""
        if d.prompt_logprobs is not None:
            self.prompt_lps = prompt_logprobs(d.prompt_logprobs)
        self.texts[d.index] += d.text
        lp = await self._logprobs(d)
        if lp:
            self.lps[d.index].extend(lp)
        if d.finished:
            self.finish[d.index] = (d.finish_reason, d.stop_reason)

    def whole(self) -> dict:
        """The non-streaming body, once every delta is in."""
        choices = [
            {
                "index": j,
                "message": {"role": "assistant", "content": self.texts[j]},
                "logprobs": {"content": self.lps[j]} if self.body.logprobs else None,
                "finish_reason": self.finish.get(j, (None, None))[0],
                "stop_reason": self.finish.get(j, (None, None))[1],
            }
            for j in range(self.n)
        ]
        return {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
            "system_fingerprint": self.state.fingerprint,
            "prompt_logprobs": self.prompt_lps,
        }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    answer = await ChatAnswer.begin(body, request)
    if body.stream:
        first, rest = await start(answer.run, request)
        return stream_response(answer.run, first, rest, answer.events)
    try:
        await collect(answer.run, request, answer.add)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    return JSONResponse(answer.whole())
