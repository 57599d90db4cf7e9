"""LoRA in the frontend: vLLM's routes ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (behind the API key like every route but health and metrics),
over the scheduler's LoadLoraAdapter / UnloadLoraAdapter; and the adapters as model variants
(model_variants.py): requests select one by ``model``, /v1/models lists them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from client.errors import LLMServeError
from frontend_svc.errors import APIError, bad_request
from frontend_svc.state import FrontendState

router = APIRouter()


class LoraAdapters:
    """The scheduler's loaded adapters as model names (a ``ModelVariants``)."""

    noun = "a LoRA adapter"

    async def names(self, client: Any) -> set[str]:
        return {a.name for a in (await client.server_info()).lora_adapters}

    def request_fields(self, name: str) -> dict[str, Any]:
        return {"lora_adapter": name}

    async def model_cards(self, client: Any, base: dict[str, Any]) -> list[dict[str, Any]]:
        # As vLLM lists them: root = the adapter's directory, parent = the base model.
        adapters = (await client.server_info()).lora_adapters
        return [
            {
                **base,
                "id": a.name,
                "root": a.path,
                "parent": base["id"],
                "supported_tasks": ["generate"],
            }
            for a in adapters
        ]


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM accepts it; names are what count here


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
    state: FrontendState = request.app.state.frontend
    if not body.lora_name:
        raise bad_request("lora_name must not be empty", "lora_name")
    if body.lora_name in (state.served_model_name, (await state.info()).model):
        raise bad_request(f"{body.lora_name!r} is the base model's name", "lora_name")
    try:
        info = await state.client.load_lora_adapter(body.lora_name, body.lora_path)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{info.name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    state: FrontendState = request.app.state.frontend
    try:
        await state.client.unload_lora_adapter(body.lora_name)
    except LLMServeError as e:
        raise APIError.from_llmserve(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
