"""Every environment variable the client library (and the frontend, a client of the scheduler)
reads, in one place: the only module of the client that touches ``os.environ``
(tests/unit/test_config_env.py checks it).

| variable | default | read by |
| --- | --- | --- |
| ``LLMSERVE_ADDRESS`` | ``127.0.0.1:50051`` | ``AsyncLLMClient``/``LLMClient``, ``llmserve`` CLI, the frontend's ``--scheduler`` |
| ``LLMSERVE_API_KEY`` | unset | the clients' key (``authorization: Bearer``); the frontend's own key and one it accepts |
| ``LLMSERVE_TLS_CA`` | unset | a CA (PEM) to trust for TLS to the scheduler |
| ``OPENAI_API_KEY`` | unset | ``client.bench``'s OpenAI backend, after ``LLMSERVE_API_KEY`` |
| ``HF_HUB_OFFLINE`` | ``1`` for the stack ``LLM`` starts | passed on to started processes (``child_environment``) |
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DEFAULT_ADDRESS = "127.0.0.1:50051"  # the port `make run` starts the scheduler on


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Where a client connects and how, as the environment says (constructor arguments win)."""

    address: str
    api_key: str | None
    tls_ca: str | None

    @classmethod
    def from_env(cls) -> ClientConfig:
        return cls(address=address(), api_key=api_key(), tls_ca=tls_ca())


def address() -> str:
    """$LLMSERVE_ADDRESS: the scheduler's host:port, else DEFAULT_ADDRESS."""
    return os.environ.get("LLMSERVE_ADDRESS") or DEFAULT_ADDRESS


def api_key() -> str | None:
    """$LLMSERVE_API_KEY (stripped), None when unset or empty."""
    return os.environ.get("LLMSERVE_API_KEY", "").strip() or None


def tls_ca() -> str | None:
    """$LLMSERVE_TLS_CA: a CA file (PEM) to trust for TLS to the scheduler."""
    return os.environ.get("LLMSERVE_TLS_CA") or None


def openai_api_key() -> str | None:
    """$OPENAI_API_KEY: the key the benchmark's OpenAI backend falls back to."""
    return os.environ.get("OPENAI_API_KEY") or None


def child_environment(
    defaults: Mapping[str, str] | None = None, drop: Iterable[str] = ()
) -> dict[str, str]:
    """The environment for a process the client starts (a local stack, a vLLM run): this
    process's, with ``defaults`` for names it does not set and without the names in ``drop``."""
    env = dict(os.environ)
    for name, value in (defaults or {}).items():
        env.setdefault(name, value)
    for name in drop:
        env.pop(name, None)
    return env
