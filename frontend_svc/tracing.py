"""OpenTelemetry traces of the frontend: a server span per HTTP request, under the caller's W3C
`traceparent` header when it sends one, whose context goes on to the scheduler in the gRPC
metadata of every call made while serving it (Generate, Resume, ...). Off unless the
standard `OTEL_*` variables name an exporter (frontend_svc/config.py); then nothing is wrapped
and the OpenTelemetry packages (the `tracing` extra) are never imported.
"""

from __future__ import annotations

from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

__all__ = ["ENABLED", "asgi", "client_interceptors", "setup"]

TRACEPARENT = "traceparent"
ENABLED = False  # set once by setup()
_tracer: Any = None
_propagator: Any = None


def setup(exporter_name: str | None, service_name: str) -> bool:
    """Turn tracing on (`exporter_name` from the config: "otlp", "console"; None: off)."""
    global ENABLED, _tracer, _propagator
    if exporter_name is None or ENABLED:
        return ENABLED
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
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = provider.get_tracer("llmserve.frontend")
    _propagator = TraceContextTextMapPropagator()
    ENABLED = True
    log.info("tracing.on", exporter=exporter_name)
    return True


def asgi(app: Any) -> Any:
    """`app` with a server span around each HTTP request (the app itself when off)."""
    if not ENABLED:
        return app
    from opentelemetry import context, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    async def traced(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = _propagator.extract(headers)
        method, path = scope["method"], scope["path"]
        span = _tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
                if message["status"] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        token = context.attach(trace.set_span_in_context(span))
        try:
            await app(scope, receive, send_status)
        finally:
            context.detach(token)
            span.end()

    return traced


def _traceparent() -> str:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)  # the current context: the HTTP request being served
    return carrier.get(TRACEPARENT, "")


class _Carry:
    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        traceparent = _traceparent()
        if not traceparent:
            return details
        metadata = grpc.aio.Metadata(
            *(tuple(m) for m in (details.metadata or ())), (TRACEPARENT, traceparent)
        )
        return details._replace(metadata=metadata)


# Two objects: grpc.aio files each interceptor under the first call kind it is an instance of.
class _CarryUnary(_Carry, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return await continuation(self._details(details), request)


class _CarryStream(_Carry, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001
        return await continuation(self._details(details), request)


def client_interceptors() -> list[Any]:
    """Interceptors that put the current trace context on the scheduler calls ([] when off)."""
    return [_CarryUnary(), _CarryStream()] if ENABLED else []
