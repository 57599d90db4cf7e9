"""What a frontend process holds: a client of the scheduler and the model's name and limits
(read once from the scheduler). No request state: any number of frontends can run side by side."""

from __future__ import annotations

import time
from typing import Any

from client.async_client import AsyncLLMClient
from client.errors import LLMServeError
from client.outputs import ServerInfo
from client.params import SamplingParams
from client.prompts import PromptInput
from frontend_svc import tracing
from frontend_svc.errors import APIError
from frontend_svc.generation import retrying
from frontend_svc.model_variants import ModelVariants
from frontend_svc.reasoning import ReasoningParser
from frontend_svc.serving import Run
from frontend_svc.tool_calling.protocol import ToolConfig

# A scheduler that restarts should be reached again quickly, not after gRPC's default back-off
# (which grows to two minutes).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class FrontendState:
    def __init__(
        self,
        scheduler_address: str,
        *,
        served_model_name: str | None = None,
        resume_timeout_s: float = 60.0,
        api_key: str | None = None,
        scheduler_tls_ca: str | None = None,
        tool_config: ToolConfig | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.scheduler_address = scheduler_address
        self.reasoning = reasoning  # --reasoning-parser
        self._special: dict[str, bool] = {}
        self.tool_config = tool_config or ToolConfig()
        self.served_model_name = served_model_name
        self.resume_timeout_s = resume_timeout_s
        self.client = AsyncLLMClient(
            scheduler_address,
            timeout=30.0,
            channel_options=CHANNEL_OPTIONS,
            api_key=api_key,
            tls_ca=scheduler_tls_ca,
            interceptors=tracing.client_interceptors(),
        )
        self._client_args = dict(
            timeout=30.0,
            channel_options=CHANNEL_OPTIONS,
            tls_ca=scheduler_tls_ca,
            interceptors=tracing.client_interceptors(),
        )
        # One client per caller key (only keys the middleware accepted ever get here): requests
        # made through the frontend belong to the caller's key on the scheduler, as if the
        # caller had used gRPC, so one tenant cannot attach to another's id.
        self._by_key: dict[str, AsyncLLMClient] = {}
        self.started = int(time.time())
        self._info: ServerInfo | None = None
        # Features serving other model names (app.py registers them), and which one serves each
        # name a request has used.
        self.model_variants: list[ModelVariants] = []
        self._variant_of: dict[str, ModelVariants] = {}

    @property
    def fingerprint(self) -> str:
        version = self._info.version if self._info is not None else ""
        return f"llmserve-{version}" if version else "llmserve"

    async def info(self) -> ServerInfo:
        if self._info is None:
            try:
                self._info = await self.client.server_info()
            except LLMServeError as e:
                raise APIError.from_llmserve(e) from None
        return self._info

    async def special_markers(self, markers: list[str]) -> set[str]:
        """Which of `markers` the served tokenizer has as special tokens (asked once per
        marker): `<...>`-shaped ones that tokenize to one token (one more than nothing, whatever
        a tokenizer adds). A constraint on the output must name such a token as a token, never
        as the text it spells."""
        todo = [m for m in markers if m not in self._special]
        if todo:
            try:
                found = await _special_markers(self.client, todo)
            except LLMServeError as e:
                raise APIError.from_llmserve(e) from None
            self._special.update({m: m in found for m in todo})
        return {m for m in markers if self._special[m]}

    async def model_name(self) -> str:
        return self.served_model_name or (await self.info()).model

    async def max_model_len(self) -> int:
        return (await self.info()).max_model_len

    async def check_model(self, model: str | None) -> str:
        """The served variant a request's ``model`` names ("" for the base model); 404 for a
        name that is neither."""
        info = await self.info()
        if model is None or model in (self.served_model_name, info.model):
            return ""
        for variants in self.model_variants:
            try:
                names = await retrying(lambda v=variants: v.names(self.client))
            except LLMServeError as e:
                raise APIError.from_llmserve(e) from None
            if model in names:
                self._variant_of[model] = variants
                return model
        raise APIError(
            404,
            f"The model `{model}` does not exist.",
            type="NotFoundError",
            param="model",
            code="model_not_found",
        )

    def variant_noun(self, variant: str) -> str:
        """What ``variant`` (a name check_model returned) is, in messages."""
        return self._variant_of[variant].noun

    async def prompt_text(self, prompt: PromptInput) -> str:
        if isinstance(prompt, str):
            return prompt
        assert isinstance(prompt, list)
        try:
            text, _ = await retrying(
                lambda: self.client.detokenize(prompt, skip_special_tokens=False)
            )
        except LLMServeError as e:
            raise APIError.from_llmserve(e) from None
        return text

    async def prompt_tokens(self, prompt: PromptInput) -> tuple[list[int], list[str]]:
        """A prompt's token ids as Generate computes them and each token's own text (a prompt's
        logprobs are per token, and the first one has no logprob entry to name it)."""
        try:
            ids, _ = await retrying(lambda: self.client.tokenize(prompt))
            _, pieces = await retrying(
                lambda: self.client.detokenize(ids, skip_special_tokens=False)
            )
        except LLMServeError as e:
            raise APIError.from_llmserve(e) from None
        return ids, pieces

    def client_for(self, api_key: str | None) -> AsyncLLMClient:
        """The scheduler client that acts with the caller's key (the frontend's own: None)."""
        if api_key is None:
            return self.client
        client = self._by_key.get(api_key)
        if client is None:
            client = AsyncLLMClient(self.scheduler_address, api_key=api_key, **self._client_args)
            self._by_key[api_key] = client
        return client

    def start_run(
        self,
        base_id: str,
        prompts: list[Any],
        params: SamplingParams,
        priority: int,
        api_key: str | None = None,
        variant: str = "",
        timeout_s: float | None = None,
    ) -> Run:
        """``variant``: what check_model returned (its features' request fields are sent);
        ``timeout_s``: the request's deadline in seconds from arrival (serving.request_timeout),
        None for the scheduler's default."""
        fields = self._variant_of[variant].request_fields(variant) if variant else {}
        if timeout_s is not None:
            fields = {**fields, "timeout_s": timeout_s}
        return Run.start(
            self.client_for(api_key),
            base_id,
            prompts,
            params,
            priority=priority,
            resume_timeout_s=self.resume_timeout_s,
            fields=fields,
        )

    async def close(self) -> None:
        await self.client.close()
        for client in self._by_key.values():
            await client.close()


async def _special_markers(client: AsyncLLMClient, markers: list[str]) -> set[str]:
    base = len((await retrying(lambda: client.tokenize("")))[0])
    out = set()
    for m in markers:
        if m.startswith("<") and m.endswith(">"):
            ids, _ = await retrying(lambda m=m: client.tokenize(m))
            if len(ids) == base + 1:
                out.add(m)
    return out
