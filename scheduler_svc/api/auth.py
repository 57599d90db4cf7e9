"""API keys on the public gRPC API: `authorization: Bearer <key>` metadata, or UNAUTHENTICATED.

Keys come from `LLMSERVE_API_KEY` (one key) and/or a key file (`--api-key-file`: one key per
line, optionally followed by a name; blank lines and `#` comments ignored). Without any key the
API is open, as before. Health checks and reflection stay open either way: load balancers and
grpcurl must reach them without a secret.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

__all__ = ["ApiKeyInterceptor", "bearer_token", "key_name", "load_api_keys"]


def load_api_keys(key_file: Path | None = None, env_key: str = "") -> dict[str, str]:
    """{key: name} from `env_key` (`LLMSERVE_API_KEY`, from the settings; named "default") and
    the key file (names default to key-N)."""
    keys: dict[str, str] = {}
    if env_key:
        keys[env_key] = "default"
    if key_file is not None:
        for n, line in enumerate(key_file.read_text().splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, name = line.partition(" ")
            keys[key] = name.strip() or f"key-{n}"
    return keys


def bearer_token(value: str) -> str:
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def key_name(keys: dict[str, str], token: str) -> str | None:
    """The name of the key `token` is, compared in constant time; None if it is none of them."""
    found = None
    for key, name in keys.items():
        if hmac.compare_digest(token.encode(), key.encode()):
            found = name
    return found


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to `services` whose metadata carries no valid key."""

    def __init__(self, keys: dict[str, str], services: frozenset[str]) -> None:
        self.keys = keys
        self.services = services

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.lstrip("/").split("/")[0] not in self.services:
            return handler
        metadata = details.invocation_metadata or ()
        token = next((bearer_token(v) for k, v in metadata if k == "authorization"), "")
        if token and key_name(self.keys, token) is not None:
            return handler
        message = "missing API key" if not token else "invalid API key"
        return _refusing(handler, message)


def _refusing(handler: Any, message: str) -> Any:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover -- makes this an async generator, like the real handler

    changes: dict[str, Any] = {}
    if handler.unary_unary is not None:
        changes["unary_unary"] = unary
    elif handler.unary_stream is not None:
        changes["unary_stream"] = stream
    elif handler.stream_unary is not None:
        changes["stream_unary"] = unary
    else:
        changes["stream_stream"] = stream
    return handler._replace(**changes)
