"""The one exception type the client raises for server-side failures."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

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


def run_guarded(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command, turning expected failures into one line on stderr and an exit code
    instead of a traceback."""
    try:
        return func(args)
    except LLMServeError as err:
        print(f"error: {err.code.name}: {err.message}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
