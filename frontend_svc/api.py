"""The OpenAI-compatible routes: completions, chat completions, models, tokenize."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.requests import Request

from client.errors import LLMServeError
from client.prompts import ChatPrompt, to_prompt
from frontend_svc.auth import caller_key
from frontend_svc.echo import prompt_echo_logprobs
from frontend_svc.errors import APIError, bad_request
from frontend_svc.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from frontend_svc.responses import (
    best_candidates,
    chat_logprobs,
    completion_logprobs,
    cumulative_logprob,
    prompt_logprobs,
    usage,
)
from frontend_svc.serving import (
    collect,
    request_id_from,
    sse,
    start,
    stream_response,
    token_texts,
)
from frontend_svc.state import FrontendState

router = APIRouter()


def _state(request: Request) -> FrontendState:
    return request.app.state.frontend


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = _state(request)
    await state.check_model(body.model)
    params = body.to_params()
    prompts = [to_prompt(p) for p in body.prompts()]
    base = request_id_from(request)
    run = state.start_run(base, prompts, params, body.priority, caller_key(request))
    rid, created, model = f"cmpl-{base}", int(time.time()), await state.model_name()
    n = params.n  # sequences per prompt: best_of of them when it is given
    echo = [await state.prompt_text(p) if body.echo else "" for p in prompts]
    offsets: dict[int, int] = {}
    echo_lp = body.echo and body.logprobs is not None
    prompt_toks = [await state.prompt_tokens(p) for p in prompts] if echo_lp else []
    echoed: set[int] = set()  # choices whose prompt part of the logprobs is made

    def echo_logprobs_of(i: int, c: int, d) -> dict | None:
        """On a choice's first delta (which carries the prompt logprobs): the prompt's part
        of its logprobs; the generated tokens' offsets continue after the prompt's texts."""
        if not echo_lp or c in echoed:
            return None
        echoed.add(c)
        ids, pieces = prompt_toks[i]
        offsets[c] = sum(len(t) for t in pieces)
        return prompt_echo_logprobs(ids, pieces, d.prompt_logprobs, body.logprobs or 0)

    async def logprobs_of(c: int, d) -> dict | None:
        if body.logprobs is None or not d.token_ids:
            return None
        lp = completion_logprobs(d, await token_texts(state.client, d), offsets.get(c, 0))
        offsets[c] = offsets.get(c, 0) + sum(len(t) for t in lp["tokens"])
        return lp

    if body.stream:
        sent_echo: set[int] = set()

        async def to_events(i, d) -> list[str]:
            if d is None:
                if not body.include_usage:
                    return []
                last = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(
                        run.num_prompt_tokens, sum(sum(s.forwarded) for s in run.streams)
                    ),
                }
                return [sse(last)]
            c = i * n + d.index
            text = d.text
            if c not in sent_echo:
                sent_echo.add(c)
                text = echo[i] + text
                offsets[c] = len(echo[i])
            head = echo_logprobs_of(i, c, d)
            lp = await logprobs_of(c, d)
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
            return [
                sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                )
            ]

        first, rest = await start(run, request)
        return stream_response(run, first, rest, to_events)

    texts = {i * n + j: echo[i] for i in range(len(prompts)) for j in range(n)}
    for c, t in texts.items():
        offsets[c] = len(t)
    finish: dict[int, tuple] = {}
    lps: dict[int, dict] = {}
    prompt_lps: dict[int, list | None] = {}
    scores: dict[int, float] = {}  # cumulative logprob of each candidate (best_of)

    async def on_delta(i, d) -> None:
        c = i * n + d.index
        if d.prompt_logprobs is not None and body.prompt_logprobs is not None:
            prompt_lps[i] = prompt_logprobs(d.prompt_logprobs)
        if body.best_of is not None:
            scores[c] = scores.get(c, 0.0) + cumulative_logprob(d)
        head = echo_logprobs_of(i, c, d)
        if head is not None:
            lps[c] = head
        lp = await logprobs_of(c, d)
        if lp is not None:
            acc = lps.setdefault(
                c, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            )
            for k in acc:
                acc[k].extend(lp[k])
        texts[c] += d.text
        if d.finished:
            finish[c] = (d.finish_reason, d.stop_reason)

    try:
        await collect(run, request, on_delta)
    except LLMServeError as e:
        err = APIError.from_llmserve(e)
        if body.best_of is not None and err.message.startswith("params.n "):
            # The scheduler sees best_of as n: name the field the client sent.
            err.message, err.param = "best_of" + err.message[len("params.n") :], "best_of"
        raise err from None
    if body.best_of is None:
        order = sorted(texts)
    else:
        order = best_candidates(scores, len(prompts), n, body.n)
    choices = [
        {
            "index": k,
            "text": texts[c],
            "logprobs": lps.get(c) if body.logprobs is not None else None,
            "finish_reason": finish.get(c, (None, None))[0],
            "stop_reason": finish.get(c, (None, None))[1],
            "prompt_logprobs": prompt_lps.get(c // n),
        }
        for k, c in enumerate(order)
    ]
    # Every candidate counts, best_of's discarded ones too: they were generated (as OpenAI
    # bills them).
    completion_tokens = sum(sum(s.forwarded) for s in run.streams)
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(run.num_prompt_tokens, completion_tokens),
            "system_fingerprint": state.fingerprint,
        }
    )


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    await state.check_model(body.model)
    params = body.to_params(await state.max_model_len())
    chat = body.chat()
    prompt = ChatPrompt(chat["messages"], chat["add_generation_prompt"])
    base = request_id_from(request)
    run = state.start_run(base, [prompt], params, body.priority, caller_key(request))
    rid, created, model = f"chatcmpl-{base}", int(time.time()), await state.model_name()

    async def logprobs_of(d) -> list | None:
        if not body.logprobs or not d.token_ids:
            return None
        return chat_logprobs(d, await token_texts(state.client, d))

    if body.stream:
        greeted: set[int] = set()

        def chunk(choices: list, **extra) -> str:
            return sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "system_fingerprint": state.fingerprint,
                    "choices": choices,
                    **extra,
                }
            )

        async def to_events(i, d) -> list[str]:
            if d is None:
                if not body.include_usage:
                    return []
                return [
                    chunk([], usage=usage(run.num_prompt_tokens, sum(run.streams[0].forwarded)))
                ]
            out = []
            if d.index not in greeted:
                greeted.add(d.index)
                out.append(
                    chunk(
                        [
                            {
                                "index": d.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            lp = await logprobs_of(d)
            if d.text or lp:
                out.append(
                    chunk(
                        [
                            {
                                "index": d.index,
                                "delta": {"content": d.text},
                                "logprobs": {"content": lp} if lp is not None else None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            if d.finished:
                out.append(
                    chunk(
                        [
                            {
                                "index": d.index,
                                "delta": {},
                                "logprobs": None,
                                "finish_reason": d.finish_reason,
                                "stop_reason": d.stop_reason,
                            }
                        ]
                    )
                )
            return out

        first, rest = await start(run, request)
        return stream_response(run, first, rest, to_events)

    texts = {j: "" for j in range(params.n)}
    lps: dict[int, list] = {j: [] for j in range(params.n)}
    finish: dict[int, tuple] = {}

    prompt_lps: list | None = None

    async def on_delta(i, d) -> None:
        nonlocal prompt_lps
        if d.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs(d.prompt_logprobs)
        texts[d.index] += d.text
        lp = await logprobs_of(d)
        if lp:
            lps[d.index].extend(lp)
        if d.finished:
            finish[d.index] = (d.finish_reason, d.stop_reason)

    try:
        await collect(run, request, on_delta)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    choices = [
        {
            "index": j,
            "message": {"role": "assistant", "content": texts[j]},
            "logprobs": {"content": lps[j]} if body.logprobs else None,
            "finish_reason": finish.get(j, (None, None))[0],
            "stop_reason": finish.get(j, (None, None))[1],
        }
        for j in range(params.n)
    ]
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(run.num_prompt_tokens, sum(run.streams[0].forwarded)),
            "system_fingerprint": state.fingerprint,
            "prompt_logprobs": prompt_lps,
        }
    )


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    name = await state.model_name()
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": state.started,
                "owned_by": "llmserve",
                "root": name,
                "max_model_len": await state.max_model_len(),
                # What the model serves: "generate" and "embed" (/v1/embeddings).
                "supported_tasks": (await state.info()).tasks or ["generate"],
            }
        ],
    }


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = _state(request)
    await state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        prompt: Any = body.prompt
    else:
        prompt = ChatPrompt(
            [{"role": m.role, "content": m.text()} for m in body.messages or []],
            body.add_generation_prompt,
        )
    try:
        ids, max_len = await state.client.tokenize(prompt)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    return {"tokens": ids, "count": len(ids), "max_model_len": max_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = _state(request)
    await state.check_model(body.model)
    try:
        text, _ = await state.client.detokenize(body.tokens)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    return {"prompt": text}
