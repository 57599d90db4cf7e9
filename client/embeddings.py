"""Embeddings through the public Embed RPC: request building, outputs, and the `embed` methods
of `AsyncLLMClient`, `LLMClient` and the offline `LLM` (mixed into them by client/features.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protos import scheduler_pb2 as pb

__all__ = [
    "POOLING_TYPES",
    "AsyncEmbedMethods",
    "EmbedMethods",
    "EmbeddingOutput",
    "OfflineEmbedMethods",
    "build_embed_request",
    "embeddings_from_proto",
]

POOLING_TYPES = {"last": pb.POOLING_TYPE_LAST, "mean": pb.POOLING_TYPE_MEAN}


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding."""

    embedding: list[float]
    num_prompt_tokens: int

    @property
    def outputs(self) -> EmbeddingOutput:
        """vLLM's offline API reads `output.outputs.embedding`."""
        return self


def as_inputs(inputs: Any) -> list[str | list[int]]:
    """A text, a token-id list, or a list of either, as a list of inputs."""
    if isinstance(inputs, str):
        return [inputs]
    items = list(inputs)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return [x if isinstance(x, str) else [int(t) for t in x] for x in items]


def build_embed_request(
    inputs: Any,
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    dimensions: int | None = None,
    priority: int = 0,
) -> pb.EmbedRequest:
    """`pooling`: "last" or "mean" (None: the server's default, last); `normalize` (None: the
    server's default, true); `dimensions`: keep the first components only."""
    req = pb.EmbedRequest(priority=priority)
    if pooling is not None:
        if pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {sorted(POOLING_TYPES)}, got {pooling!r}")
        req.pooling = POOLING_TYPES[pooling]
    if normalize is not None:
        req.normalize = normalize
    if dimensions is not None:
        req.dimensions = dimensions
    for x in as_inputs(inputs):
        if isinstance(x, str):
            req.inputs.add(text=x)
        else:
            req.inputs.add(token_ids=pb.TokenIds(ids=x))
    return req


def embeddings_from_proto(resp: pb.EmbedResponse) -> list[EmbeddingOutput]:
    return [EmbeddingOutput(list(e.values), e.num_prompt_tokens) for e in resp.embeddings]


class AsyncEmbedMethods:
    """``AsyncLLMClient.embed`` (the client's ``_unary`` calls the RPC)."""

    async def embed(
        self,
        inputs: Any,
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        priority: int = 0,
    ) -> list[EmbeddingOutput]:
        """Embeddings of a text, a token-id list, or a list of either (client/embeddings.py)."""
        req = build_embed_request(
            inputs, pooling=pooling, normalize=normalize, dimensions=dimensions, priority=priority
        )
        return embeddings_from_proto(await self._unary("Embed", req))  # type: ignore[attr-defined]


class EmbedMethods:
    """``LLMClient.embed`` (over its ``AsyncLLMClient``)."""

    def embed(self, inputs: Any, **kwargs: Any) -> list[EmbeddingOutput]:
        """As AsyncLLMClient.embed (pooling, normalize, dimensions, priority)."""
        return self._run(self._async.embed(inputs, **kwargs))  # type: ignore[attr-defined]


class OfflineEmbedMethods:
    """The offline ``LLM.embed`` (over its ``LLMClient``)."""

    def embed(self, prompts: Any, **kwargs: Any) -> list[EmbeddingOutput]:
        """One EmbeddingOutput per prompt (`.outputs.embedding` as in vLLM); keyword arguments
        as LLMClient.embed (pooling "last" or "mean", normalize, dimensions)."""
        return self._client.embed(prompts, **kwargs)  # type: ignore[attr-defined]
