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
    "trace_step_every",
    "tracing_exporter",
    "tracing_service_name",
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


def tracing_exporter() -> str | None:
    """The OpenTelemetry span exporter the standard variables ask for ("otlp", "console"), or
    None: tracing off. `OTEL_SDK_DISABLED=true` turns it off; `OTEL_TRACES_EXPORTER` names one
    ("none": off); without it an endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) means "otlp". The exporter itself reads the rest
    (endpoint, headers, `OTEL_BSP_*`, `OTEL_TRACES_SAMPLER`)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    named = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if named:
        return None if named == "none" else named.split(",")[0].strip()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return "otlp" if endpoint else None


def tracing_service_name() -> str:
    """`OTEL_SERVICE_NAME`: the service name on this scheduler's spans."""
    return os.environ.get("OTEL_SERVICE_NAME") or "llmserve-scheduler"


def trace_step_every() -> int:
    """`LLMSERVE_TRACE_STEP_EVERY`: with tracing on, one engine step in this many is traced into
    the executor even when no traced request starts in it (0: only those steps)."""
    return int(os.environ.get("LLMSERVE_TRACE_STEP_EVERY") or 100)
