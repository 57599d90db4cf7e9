"""Every LLMSERVE_* environment variable the client library (and the frontend, a client of the
scheduler) reads, in one place."""

from __future__ import annotations

import os

DEFAULT_ADDRESS = "127.0.0.1:50051"  # the port `make run` starts the scheduler on


def address() -> str:
    """$LLMSERVE_ADDRESS: the scheduler's host:port, else DEFAULT_ADDRESS."""
    return os.environ.get("LLMSERVE_ADDRESS") or DEFAULT_ADDRESS


def api_key() -> str | None:
    """$LLMSERVE_API_KEY (stripped), None when unset or empty."""
    return os.environ.get("LLMSERVE_API_KEY", "").strip() or None


def tls_ca() -> str | None:
    """$LLMSERVE_TLS_CA: a CA file (PEM) to trust for TLS to the scheduler."""
    return os.environ.get("LLMSERVE_TLS_CA") or None
