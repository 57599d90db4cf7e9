"""The frontend's hook for features that add request fields to the OpenAI bodies and turn them
into sampling parameters (a constraint on the output, say). ``features.py`` lists them; the protocol models mix in their fields and the
request handlers (chat, completions, responses, messages) iterate the hooks, naming no feature.

This module imports nothing of the frontend."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["RequestFields"]


class RequestFields(Protocol):
    # A pydantic model mixed into the bodies of /v1/chat/completions and /v1/completions (and
    # so into the chat request that the Responses and Messages APIs translate into).
    body_fields: type

    def to_params(self, body: Any, params: Any, plan: Any) -> None:
        """Set the client ``SamplingParams`` from the body's fields; ``plan``: a chat call's
        ``ToolPlan`` (None for completions), whose tool_choice may ask the same of the output."""
        ...

    async def fit(self, params: Any, plan: Any, state: Any) -> None:
        """A chat call's parameters fitted to the served model (``state``: the
        ``FrontendState``: its reasoning parser, its tokenizer's special tokens)."""
        ...

    def named(self, err: Any, body: Any, plan: Any, alias: str | None) -> Any:
        """The scheduler's refusal (an ``APIError``) of what the fields asked, with the field
        the client used as its ``param``; ``alias``: that field's name in the API called (the
        Responses API's), None for the body's own."""
        ...

    def responses_fields(self, body: Any) -> dict[str, Any]:
        """The chat request's fields that a Responses API body's own translate into."""
        ...
