"""The frontend's optional features, each registered here on the frontend's hooks (and nowhere
else named by the code that serves requests):

- request fields (request_fields.py): fields mixed into the OpenAI bodies and turned into
  sampling parameters; the handlers call ``to_params``/``fit``/``named`` below;
- response fields (response_fields.py): fields of a whole chat answer (``response_fields``);
- model variants (model_variants.py): other ``model`` names a request may select, and their
  /v1/models entries (``FrontendState.model_variants``);
- routes: each feature's own endpoints (and those a Batch API line may name).

Which feature uses which hook: docs/internals.md, "Features"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter

from frontend_svc.embeddings import router as _embeddings_router
from frontend_svc.errors import APIError
from frontend_svc.logprobs import PromptLogprobsField
from frontend_svc.lora_api import LoraAdapters
from frontend_svc.lora_api import router as _lora_router
from frontend_svc.model_variants import ModelVariants
from frontend_svc.request_fields import RequestFields
from frontend_svc.response_fields import ResponseField
from frontend_svc.structured.hooks import StructuredOutputs

REQUEST_FIELDS: tuple[RequestFields, ...] = (StructuredOutputs(),)
# The request-field features' body fields, as pydantic mixins of the request models.
BODY_FIELDS: tuple[type, ...] = tuple(f.body_fields for f in REQUEST_FIELDS)
# /v1/embeddings; /v1/load_lora_adapter and /v1/unload_lora_adapter.
ROUTERS: tuple[APIRouter, ...] = (_embeddings_router, _lora_router)
# The features' endpoints that a Batch API line may name (after chat and completions).
BATCH_ENDPOINTS: tuple[str, ...] = ("/v1/embeddings",)


# The features' fields of a whole chat answer, each made anew per call.
RESPONSE_FIELDS: tuple[Callable[[], ResponseField], ...] = (PromptLogprobsField,)


def response_fields() -> list[ResponseField]:
    """One chat call's response fields (in the body after its own, in this order)."""
    return [make() for make in RESPONSE_FIELDS]


def model_variants() -> list[ModelVariants]:
    """A new frontend's model variants (adapters loaded into the scheduler)."""
    return [LoraAdapters()]


def to_params(body: Any, params: Any, plan: Any = None) -> None:
    """The request-field features' parts of ``params`` (``plan``: a chat call's ToolPlan)."""
    for f in REQUEST_FIELDS:
        f.to_params(body, params, plan)


async def fit(params: Any, plan: Any, state: Any) -> None:
    """A chat call's parameters fitted to the served model."""
    for f in REQUEST_FIELDS:
        await f.fit(params, plan, state)


def named(err: APIError, body: Any, plan: Any = None, alias: str | None = None) -> APIError:
    """A scheduler's refusal with the request field that asked for what it refused."""
    for f in REQUEST_FIELDS:
        err = f.named(err, body, plan, alias)
    return err


def responses_fields(body: Any) -> dict[str, Any]:
    """The chat fields that a Responses API body's feature fields translate into."""
    out: dict[str, Any] = {}
    for f in REQUEST_FIELDS:
        out.update(f.responses_fields(body))
    return out
