"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status a client of the OpenAI API expects for it; on Anthropic's routes (/v1/messages),
in Anthropic's: `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from client.errors import LLMServeError

# gRPC status of the scheduler -> (HTTP status, OpenAI error type).
_BY_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    # The request's deadline passed before it produced anything (its `timeout`).
    grpc.StatusCode.DEADLINE_EXCEEDED: (408, "timeout"),
}


# HTTP status -> Anthropic's error type.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    """An error the frontend answers with; `status` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def anthropic_body(self) -> dict:
        """The error in the shape of Anthropic's Messages API (/v1/messages)."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response_for(self, path: str) -> JSONResponse:
        """The response in the shape of the API `path` belongs to."""
        if is_anthropic(path):
            return JSONResponse(self.anthropic_body(), status_code=self.status)
        return self.response()

    @classmethod
    def from_llmserve(cls, err: LLMServeError) -> APIError:
        status, kind = _BY_GRPC.get(err.code, (500, "server_error"))
        message = err.message if status != 500 else f"internal error ({err.code.name})"
        return cls(status, message, type=kind)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
