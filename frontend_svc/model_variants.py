"""The frontend's hook for features that serve more than the base model under other ``model``
names (adapters loaded into the scheduler): which names they serve now, the Generate fields
that select one (request fields), and their /v1/models entries (response fields). ``app.py``
registers them on the ``FrontendState``; the request handlers only ask the state
(``check_model``, ``start_run``) and name no feature.

This module imports nothing of the frontend."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ModelVariants"]


class ModelVariants(Protocol):
    # What one of its names is, in error messages ("... of {noun} are not supported").
    noun: str

    async def names(self, client: Any) -> set[str]:
        """The model names served now (read again each time: they may change live)."""
        ...

    def request_fields(self, name: str) -> dict[str, Any]:
        """Keyword arguments of ``AsyncLLMClient.stream`` that select ``name``."""
        ...

    async def model_cards(self, client: Any, base: dict[str, Any]) -> list[dict[str, Any]]:
        """/v1/models entries of the names served now; ``base`` is the base model's entry."""
        ...
