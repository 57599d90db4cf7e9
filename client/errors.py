"""The one exception type the client raises for server-side failures."""

from __future__ import annotations

import grpc


class LLMServeError(Exception):
    """A gRPC call failed: `code` is the status (e.g. `grpc.StatusCode.INVALID_ARGUMENT`) and
    `message` the server's explanation, written for a person."""

    def __init__(self, code: grpc.StatusCode, message: str, *, request_id: str | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, *, request_id: str | None = None) -> LLMServeError:
        # grpc.aio raises AioRpcError and sync grpc raises _InactiveRpcError / _MultiThreadedRendezvous;
        # all of them carry code() and details().
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", request_id=request_id)
