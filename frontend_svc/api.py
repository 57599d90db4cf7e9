"""The OpenAI-compatible routes besides generation: models, tokenize, detokenize (completions:
`completions_api`, chat: `chat_api`, responses: `responses_api`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request

from client.errors import LLMServeError
from client.prompts import ChatPrompt
from frontend_svc.errors import APIError, bad_request
from frontend_svc.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
)
from frontend_svc.state import FrontendState

router = APIRouter()


def _state(request: Request) -> FrontendState:
    return request.app.state.frontend


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    name = await state.model_name()
    base = {
        "id": name,
        "object": "model",
        "created": state.started,
        "owned_by": "llmserve",
        "root": name,
        "parent": None,
        "max_model_len": await state.max_model_len(),
        # The tasks the model serves, as the scheduler lists them (GetServerInfo.tasks).
        "supported_tasks": (await state.info()).tasks or ["generate"],
    }
    cards = []  # the features' other model names (model_variants.py)
    try:
        for variants in state.model_variants:
            cards += await variants.model_cards(state.client, base)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    return {"object": "list", "data": [base, *cards]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = _state(request)
    await state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        prompt: Any = body.prompt
    else:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        prompt = ChatPrompt(
            [m.to_dict() for m in body.messages or []], body.add_generation_prompt, tools or None
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
