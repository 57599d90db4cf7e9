"""The frontend's hook for features that add fields to a whole (non-streamed) chat answer: one
``ResponseField`` per call, fed each stream delta, whose ``fields`` go after the body's own.
``features.py`` lists them; ``chat_api.ChatAnswer`` iterates them, naming no feature.

This module imports nothing of the frontend."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ResponseField"]


class ResponseField(Protocol):
    def add(self, d: Any) -> None:
        """Fold one ``StreamDelta`` of the call in."""
        ...

    def fields(self) -> dict[str, Any]:
        """Its fields of the whole body, once every delta is in."""
        ...
