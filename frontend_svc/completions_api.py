"""`POST /v1/completions`: one call's answer as an object that owns its choices (texts,
logprobs, text offsets, finishes), fed the run's deltas and shaped as stream events or one body.

Choice `c = i * n + j` is sequence j of prompt i (n = best_of when given, else n). With `echo`
each choice starts with its prompt's text, and with `echo` + `logprobs` its logprobs start with
the prompt's tokens (the first one null), carried by the choice's first delta.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request

from client.errors import LLMServeError
from client.outputs import StreamDelta
from client.prompts import to_prompt
from frontend_svc import features
from frontend_svc.auth import caller_key
from frontend_svc.echo import prompt_echo_logprobs
from frontend_svc.errors import APIError
from frontend_svc.logprobs import (
    best_candidates,
    completion_logprobs,
    cumulative_logprob,
    prompt_logprobs,
    usage,
)
from frontend_svc.protocol import CompletionRequest
from frontend_svc.serving import Run, request_id_from, request_timeout, respond, sse
from frontend_svc.serving import token_texts as _token_texts
from frontend_svc.state import FrontendState

router = APIRouter()

_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class CompletionAnswer:
    """What one /v1/completions call has produced so far."""

    def __init__(
        self,
        body: CompletionRequest,
        state: FrontendState,
        run: Run,
        echo: list[str],
        prompt_toks: list[tuple[list[int], list[str]]],
        model: str,
        request_id: str,
        n: int,
    ) -> None:
        self.body, self.state, self.run, self.model = body, state, run, model
        self.rid, self.created = f"cmpl-{request_id}", int(time.time())
        self.n = n  # sequences per prompt: best_of of them when given
        self.num_prompts = len(echo)
        self.echo = echo
        self.prompt_toks = prompt_toks
        self.echo_lp = body.echo and body.logprobs is not None
        self.echoed: set[int] = set()  # choices whose prompt part of the logprobs is made
        self.started: set[int] = set()  # streamed choices whose echoed prompt went out
        self.texts = {
            i * self.n + j: echo[i] for i in range(self.num_prompts) for j in range(self.n)
        }
        # Each choice's text offset of its next token: after its echoed prompt.
        self.offsets = {c: len(t) for c, t in self.texts.items()}
        self.lps: dict[int, dict] = {}
        self.prompt_lps: dict[int, list | None] = {}
        self.finish: dict[int, tuple] = {}
        self.scores: dict[int, float] = {}  # cumulative logprob of each candidate (best_of)

    @classmethod
    async def begin(cls, body: CompletionRequest, request: Request) -> CompletionAnswer:
        """Check the call, start its run, and read what echo needs of the prompts."""
        state: FrontendState = request.app.state.frontend
        variant = await state.check_model(body.model)
        prompts = [to_prompt(p) for p in body.prompts()]
        base = request_id_from(request)
        params = body.to_params()
        timeout_s = request_timeout(request, body.timeout)
        run = state.start_run(base, prompts, params, body.priority, caller_key(request), variant,
                              timeout_s=timeout_s)  # fmt: skip
        model = variant or await state.model_name()
        echo = [await state.prompt_text(p) if body.echo else "" for p in prompts]
        toks = []
        if body.echo and body.logprobs is not None:
            toks = [await state.prompt_tokens(p) for p in prompts]
        return cls(body, state, run, echo, toks, model, base, params.n)

    def _echo_logprobs(self, i: int, c: int, d: StreamDelta) -> dict | None:
        """On a choice's first delta (which carries the prompt logprobs): the prompt's part
        of its logprobs; the generated tokens' offsets continue after the prompt's texts."""
        if not self.echo_lp or c in self.echoed:
            return None
        self.echoed.add(c)
        ids, pieces = self.prompt_toks[i]
        self.offsets[c] = sum(len(t) for t in pieces)
        return prompt_echo_logprobs(ids, pieces, d.prompt_logprobs, self.body.logprobs or 0)

    async def _logprobs(self, c: int, d: StreamDelta) -> dict | None:
        if self.body.logprobs is None or not d.token_ids:
            return None
        texts = await _token_texts(self.state.client, d)
        lp = completion_logprobs(d, texts, self.offsets.get(c, 0))
        self.offsets[c] = self.offsets.get(c, 0) + sum(len(t) for t in lp["tokens"])
        return lp

    def _envelope(self, choices: list, **extra: Any) -> dict:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _usage(self) -> dict:
        # Every candidate counts, best_of's discarded ones too: they were generated (as OpenAI
        # bills them).
        return usage(self.run.num_prompt_tokens, sum(sum(s.forwarded) for s in self.run.streams))

    async def events(self, i: int | None, d: StreamDelta | None) -> list[str]:
        """The stream events of one delta; of (None, None) the closing usage chunk."""
        if d is None or i is None:
            return [sse(self._envelope([], usage=self._usage()))] if self.body.include_usage else []
        c = i * self.n + d.index
        text = d.text
        if c not in self.started:
            self.started.add(c)
            text = self.echo[i] + text
        head = self._echo_logprobs(i, c, d)
        lp = await self._logprobs(c, d)
        if head is not None:
            for k in head:
                head[k].extend(lp[k] if lp is not None else [])
            lp = head
        choice = {
            "index": c,
            "text": text,
            "logprobs": lp,
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }
        # continuous_usage_stats: the usage so far on every chunk (as vLLM).
        extra = {"usage": self._usage()} if self.body.continuous_usage else {}
        return [sse(self._envelope([choice], **extra))]

    async def add(self, i: int, d: StreamDelta) -> None:
        """Fold one delta into the whole answer (non-streaming)."""
        c = i * self.n + d.index
        if d.prompt_logprobs is not None and self.body.prompt_logprobs is not None:
            self.prompt_lps[i] = prompt_logprobs(d.prompt_logprobs)
        if self.body.best_of is not None:
            self.scores[c] = self.scores.get(c, 0.0) + cumulative_logprob(d)
        head = self._echo_logprobs(i, c, d)
        if head is not None:
            self.lps[c] = head
        lp = await self._logprobs(c, d)
        if lp is not None:
            acc = self.lps.setdefault(c, {k: [] for k in _LOGPROB_KEYS})
            for k in acc:
                acc[k].extend(lp[k])
        self.texts[c] += d.text
        if d.finished:
            self.finish[c] = (d.finish_reason, d.stop_reason)

    def error(self, e: LLMServeError | APIError) -> APIError:
        err = e if isinstance(e, APIError) else APIError.from_llmserve(e)
        err = features.named(err, self.body)
        if self.body.best_of is not None and err.message.startswith("params.n "):
            # The scheduler sees best_of as n: name the field the client sent.
            err.message, err.param = "best_of" + err.message[len("params.n") :], "best_of"
        return err

    def whole(self) -> dict:
        """The non-streaming body, once every delta is in."""
        if self.body.best_of is None:
            order = sorted(self.texts)
        else:
            order = best_candidates(self.scores, self.num_prompts, self.n, self.body.n)
        choices = [
            {
                "index": k,
                "text": self.texts[c],
                "logprobs": self.lps.get(c) if self.body.logprobs is not None else None,
                "finish_reason": self.finish.get(c, (None, None))[0],
                "stop_reason": self.finish.get(c, (None, None))[1],
                "prompt_logprobs": self.prompt_lps.get(c // self.n),
            }
            for k, c in enumerate(order)
        ]
        return self._envelope(
            choices, usage=self._usage(), system_fingerprint=self.state.fingerprint
        )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await respond(await CompletionAnswer.begin(body, request), body.stream, request)
