"""Every environment variable the scheduler reads, in one place.

Each is read when asked for (not at import), so a test that sets one before starting a process
or calling a function sees it. Command-line flags win over these where both exist: the CLI uses
them only as defaults.
"""

from __future__ import annotations

import os

__all__ = [
    "api_key",
    "failpoints",
    "local_model",
    "redis_min_replicas",
    "redis_sentinel",
    "redis_sentinel_master",
    "redis_sentinel_password",
    "redis_url",
]


def api_key() -> str:
    """`LLMSERVE_API_KEY`: one API key of the public API ("" = none; a key file may add more)."""
    return os.environ.get("LLMSERVE_API_KEY", "").strip()


def failpoints() -> str:
    """`LLMSERVE_FAILPOINTS`: the failpoints a test arms (scheduler_svc/failpoints.py)."""
    return os.environ.get("LLMSERVE_FAILPOINTS", "")


def local_model() -> str:
    """`LLMSERVE_MODEL`: the model `make run` serves (a checkpoint directory, or "demo")."""
    return os.environ.get("LLMSERVE_MODEL", "demo")


def redis_url() -> str | None:
    """`REDIS_URL`: the Redis holding request state (None: start a loopback one)."""
    return os.environ.get("REDIS_URL")


def redis_sentinel() -> str | None:
    """`LLMSERVE_REDIS_SENTINEL`: Sentinels as host:port[,host:port...] (None: plain Redis)."""
    return os.environ.get("LLMSERVE_REDIS_SENTINEL") or None


def redis_sentinel_master() -> str:
    """`LLMSERVE_REDIS_SENTINEL_MASTER`: the name the Sentinels monitor the primary under."""
    return os.environ.get("LLMSERVE_REDIS_SENTINEL_MASTER") or "mymaster"


def redis_sentinel_password() -> str | None:
    """`LLMSERVE_REDIS_SENTINEL_PASSWORD`: the Sentinels' own password (requirepass), if any;
    an environment variable only, so it never shows in a process list."""
    return os.environ.get("LLMSERVE_REDIS_SENTINEL_PASSWORD") or None


def redis_min_replicas() -> int:
    """`LLMSERVE_REDIS_MIN_REPLICAS`: the default of --redis-min-replicas (0)."""
    return int(os.environ.get("LLMSERVE_REDIS_MIN_REPLICAS") or 0)
