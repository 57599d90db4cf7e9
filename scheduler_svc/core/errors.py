"""Errors the engine raises for the servicer to map onto gRPC status codes."""

from scheduler_svc.core.sampling_params import ValidationError


class EngineError(Exception):
    """Base class; the message is shown to clients as it is."""


class NotFound(EngineError):
    """Unknown (or expired) request id."""


class QueueFull(EngineError):
    """The waiting queue is at its configured cap."""


class NotMovable(EngineError):
    """The request exists but cannot move to another executor now (admin MoveRequest)."""


class Unavailable(EngineError):
    """No executor connected, Redis down, or the engine shutting down."""


__all__ = ["EngineError", "NotFound", "NotMovable", "QueueFull", "Unavailable", "ValidationError"]
