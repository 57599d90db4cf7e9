"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status a client of the OpenAI API expects for it."""

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
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


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

    @classmethod
    def from_llmserve(cls, err: LLMServeError) -> APIError:
        status, kind = _BY_GRPC.get(err.code, (500, "server_error"))
        message = err.message if status != 500 else f"internal error ({err.code.name})"
        return cls(status, message, type=kind)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
