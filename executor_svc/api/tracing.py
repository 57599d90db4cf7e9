"""OpenTelemetry spans of the executor: one `execute_model` span per step the scheduler sampled
(it sends that step's W3C `traceparent` in the ExecuteModel metadata); off unless the standard
`OTEL_*` variables name an exporter (config/envs.py). Unsampled steps, and every step with
tracing off, cost one flag check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from executor_svc.config import envs

log = structlog.get_logger(__name__)

__all__ = ["ENABLED", "setup", "traced_step"]

T = TypeVar("T")
TRACEPARENT = "traceparent"
ENABLED = False  # set once by setup()
_tracer: Any = None
_propagator: Any = None


def setup() -> bool:
    """Turn tracing on when the environment asks for it and the packages are there."""
    global ENABLED, _tracer, _propagator
    exporter_name = envs.tracing_exporter()
    if exporter_name is None:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        log.warning("tracing.unavailable", hint="pip install 'llmserve[tracing]'")
        return False
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers, TLS: from the OTEL_* variables
    resource = Resource.create({"service.name": envs.tracing_service_name()})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = provider.get_tracer("llmserve.executor")
    _propagator = TraceContextTextMapPropagator()
    ENABLED = True
    log.info("tracing.on", exporter=exporter_name)
    return True


def traced_step(metadata: Any, request: Any, execute: Callable[[Any], T]) -> T:
    """`execute(request)`, inside an `execute_model` span when the scheduler sampled the step."""
    parent = next((v for k, v in metadata or () if k == TRACEPARENT), "")
    if not parent:
        return execute(request)
    try:
        ctx = _propagator.extract({TRACEPARENT: parent})
        attributes = {
            "llmserve.step_id": request.step_id,
            "llmserve.num_new_seqs": len(request.new_sequences),
            "llmserve.num_cached_seqs": len(request.cached_sequences),
            "llmserve.num_decode_seqs": len(request.decode_seq_ids),
        }
        span = _tracer.start_span("execute_model", context=ctx, attributes=attributes)
    except Exception:  # tracing never fails a step
        log.exception("tracing.span_failed")
        return execute(request)
    try:
        return execute(request)
    finally:
        span.end()
