"""API keys on the HTTP API: `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's
SDK), or 401 in the API's error shape.

The same keys as the scheduler's (`LLMSERVE_API_KEY`, `--api-key-file`: one key per line,
optionally followed by a name). `/health` and `/metrics` stay open. The frontend calls the
scheduler with its own key (`$LLMSERVE_API_KEY`, else the file's first key).
"""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.requests import Request

from frontend_svc.errors import APIError

__all__ = ["api_key_asgi", "caller_key", "load_api_keys"]

OPEN_PATHS = frozenset({"/health", "/metrics"})


def load_api_keys(key_file: Path | None = None, env_key: str | None = None) -> list[str]:
    """The keys, ``env_key`` ($LLMSERVE_API_KEY, from the config) first, then the file's in
    order."""
    keys = []
    if env_key:
        keys.append(env_key)
    if key_file is not None:
        for line in key_file.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line.split()[0])
    return keys


def caller_key(request: Request) -> str | None:
    """The caller's API key when keys are on (the middleware has checked it), else None."""
    if not request.app.state.api_keys:
        return None
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


def _valid(keys: list[str], token: bytes) -> bool:
    ok = False
    for key in keys:  # constant time, and every key compared
        ok |= hmac.compare_digest(token, key.encode())
    return ok


def api_key_asgi(keys: list[str]):
    """`wrap(app) -> app` refusing API calls without one of `keys` (no keys: no check)."""

    def wrap(app):
        if not keys:
            return app

        async def call(scope, receive, send) -> None:
            if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
                await app(scope, receive, send)
                return
            headers = dict(scope["headers"])
            value = headers.get(b"authorization", b"")
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() != b"bearer":
                # Anthropic's SDK sends its key as x-api-key.
                token = headers.get(b"x-api-key", b"")
            if token and _valid(keys, token.strip()):
                await app(scope, receive, send)
                return
            given = value or headers.get(b"x-api-key")
            message = "invalid API key" if given else "missing API key (Authorization: Bearer)"
            error = APIError(401, message, type="authentication_error", code="invalid_api_key")
            await error.response_for(scope["path"])(scope, receive, send)

        return call

    return wrap
