"""`/v1/embeddings` in the OpenAI shape, over the scheduler's Embed RPC.

Body: `input` (a string, a list of strings, a token-id list, or a list of token-id lists),
`model`, `encoding_format` ("float" or "base64": little-endian float32, as OpenAI), `dimensions`
(keep the first components), `user` (a label, accepted as vLLM does: the allow-list of docs/openai.md); vLLM's extras `normalize`
(default true) and `priority`, and `pooling` ("last", the default for decoder models as in
vLLM, or "mean"). An unknown field is a 400 naming it. The call is idempotent and nothing
of it is stored, so a scheduler restart mid-call is retried here, transparently.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from client.errors import LLMServeError
from frontend_svc.auth import caller_key
from frontend_svc.errors import APIError, bad_request
from frontend_svc.generation import retrying
from frontend_svc.state import FrontendState

__all__ = ["EmbeddingRequest", "router"]

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras.
    normalize: bool | None = None
    pooling: Literal["last", "mean"] | None = None
    priority: int = 0

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise bad_request("input must not be an empty list", "input")
        inputs = [list(x)] if all(isinstance(t, int) for t in x) else list(x)
        for ids in inputs:
            if not isinstance(ids, str) and not all(0 <= t < 2**32 for t in ids):
                raise bad_request("input: token ids must be in [0, 2^32)", "input")
        return inputs  # type: ignore[return-value]


def _encode(vec: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    state: FrontendState = request.app.state.frontend
    if variant := await state.check_model(body.model):
        noun = state.variant_noun(variant)
        raise bad_request(f"embeddings of {noun} are not supported; use the base model", "model")
    inputs = body.inputs()
    if body.dimensions is not None and body.dimensions < 1:
        raise bad_request(f"dimensions must be >= 1, got {body.dimensions}", "dimensions")
    client = state.client_for(caller_key(request))
    try:
        outputs = await retrying(
            lambda: client.embed(
                inputs,
                pooling=body.pooling,
                normalize=body.normalize,
                dimensions=body.dimensions,
                priority=body.priority,
            )
        )
    except LLMServeError as e:
        err = APIError.from_llmserve(e)
        if err.status == 400:  # the scheduler's message names its field
            err.param = "dimensions" if e.message.startswith("dimensions") else "input"
        raise err from None
    num_tokens = sum(o.num_prompt_tokens for o in outputs)
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": await state.model_name(),
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encode(o.embedding, body.encoding_format),
            }
            for i, o in enumerate(outputs)
        ],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
