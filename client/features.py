"""The client's optional features, composed here into the public classes (and nowhere else
named by them): each feature's methods as a mixin of `AsyncLLMClient`, `LLMClient` and the
offline `LLM`; its `SamplingParams` fields with the client's types; its `llmserve generate`
flags; its public output types, which `client/__init__.py` exports from here. The public API
(methods, keyword arguments, flags, types) is each feature's own, unchanged.

Which feature gives what: docs/internals.md, "Features"."""

from __future__ import annotations

import argparse
from typing import Any

from client.embeddings import (
    AsyncEmbedMethods,
    EmbeddingOutput,
    EmbedMethods,
    OfflineEmbedMethods,
)
from client.structured import StructuredParams, add_flags, from_args

__all__ = [
    "AsyncClientFeatures",
    "ClientFeatures",
    "EmbeddingOutput",
    "OfflineFeatures",
    "ParamsFeatures",
    "add_sampling_flags",
    "sampling_fields",
]


class AsyncClientFeatures(AsyncEmbedMethods):
    """The features' methods of `AsyncLLMClient` (embed)."""


class ClientFeatures(EmbedMethods):
    """The features' methods of `LLMClient` (embed)."""


class OfflineFeatures(OfflineEmbedMethods):
    """The features' methods of the offline `LLM` (embed)."""


# The shared SamplingParams model with the features' fields in the client's types (a dataclass
# chain: each feature's subclass retypes its fields, keeping the shared model's order).
ParamsFeatures = StructuredParams


def add_sampling_flags(gen: argparse.ArgumentParser) -> None:
    """The features' `llmserve generate` flags that set SamplingParams fields."""
    add_flags(gen)


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields of those flags."""
    return from_args(args)
