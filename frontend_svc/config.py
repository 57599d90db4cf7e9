"""The frontend's configuration: one typed object, ``FrontendConfig``, built once by the CLI from
its flags and the environment, and handed to the app.

The frontend is a client of the scheduler's public API, so its variables are the client's
(``client/envs.py``): ``LLMSERVE_ADDRESS`` (default of ``--scheduler``), ``LLMSERVE_API_KEY`` (a
key callers may use, and the one the frontend calls the scheduler with) and ``LLMSERVE_TLS_CA``
(default of ``--scheduler-tls-ca``). The Batch API's store also takes the scheduler's Redis
variables (``BATCH_ENV``) as its flags' defaults, so one deployment's settings serve both. This
module is the only one of the frontend that asks for
them, and it passes what it found on explicitly; no frontend module reads ``os.environ``
(tests/unit/test_config_env.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from client.envs import ClientConfig
from frontend_svc.batch.flags import batch_settings
from frontend_svc.batch.settings import BatchSettings

ENVIRONMENT_HELP = """\
environment (flags win where both exist):
  LLMSERVE_ADDRESS    the scheduler's host:port (--scheduler; default 127.0.0.1:50051)
  LLMSERVE_API_KEY    an API key callers may use; the frontend's own key for the scheduler
  LLMSERVE_TLS_CA     trust this CA for TLS to the scheduler (--scheduler-tls-ca)
  LLMSERVE_REDIS_SENTINEL           the Batch API's Sentinels (--redis-sentinel)
  LLMSERVE_REDIS_SENTINEL_MASTER    their primary's name (--redis-sentinel-master)
  LLMSERVE_REDIS_SENTINEL_PASSWORD  the Sentinels' own password
  LLMSERVE_REDIS_MIN_REPLICAS       --redis-min-replicas (0)
  OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_SDK_DISABLED
                      OpenTelemetry traces (off unless an exporter or endpoint is named)
"""

# The scheduler's Redis variables, read here for the Batch API's store (frontend_svc/batch).
BATCH_ENV = (
    "LLMSERVE_REDIS_SENTINEL",
    "LLMSERVE_REDIS_SENTINEL_MASTER",
    "LLMSERVE_REDIS_SENTINEL_PASSWORD",
    "LLMSERVE_REDIS_MIN_REPLICAS",
)


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    # server
    host: str
    port: int
    port_file: Path | None
    log_level: str
    tls_cert: Path | None
    tls_key: Path | None
    # scheduler
    scheduler: str  # one address, or several comma-separated (leader election)
    scheduler_tls_ca: str | None
    served_model_name: str | None
    resume_timeout_s: float
    # auth: $LLMSERVE_API_KEY first, then --api-key-file's keys in order
    api_key_file: Path | None
    env_api_key: str | None
    # tools
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    tool_parser_plugin: Path | None
    # reasoning
    reasoning_parser: str | None
    # the Batch API (frontend_svc/batch)
    batch: BatchSettings
    # OpenTelemetry (frontend_svc/tracing.py): the exporter the OTEL_* variables name (None: off)
    tracing_exporter: str | None = None
    tracing_service_name: str = "llmserve-frontend"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FrontendConfig:
        env = ClientConfig.from_env()
        return cls(
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            log_level=args.log_level,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            scheduler=args.scheduler or env.address,
            scheduler_tls_ca=str(args.scheduler_tls_ca) if args.scheduler_tls_ca else env.tls_ca,
            served_model_name=args.served_model_name,
            resume_timeout_s=args.resume_timeout,
            api_key_file=args.api_key_file,
            env_api_key=env.api_key,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            tool_parser_plugin=args.tool_parser_plugin,
            reasoning_parser=args.reasoning_parser,
            batch=batch_settings(args, {k: os.environ.get(k, "") for k in BATCH_ENV}),
            tracing_exporter=tracing_exporter(),
            tracing_service_name=tracing_service_name(),
        )


def tracing_exporter() -> str | None:
    """The OpenTelemetry span exporter the standard variables ask for ("otlp", "console"), or
    None: tracing off (the scheduler's rule, scheduler_svc/envs.py)."""
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
    """`OTEL_SERVICE_NAME`: the service name on this frontend's spans."""
    return os.environ.get("OTEL_SERVICE_NAME") or "llmserve-frontend"
