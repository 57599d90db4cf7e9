"""OpenTelemetry traces of the scheduler: off unless the standard `OTEL_*` variables name an
exporter (scheduler_svc/envs.py), and then only per request and per sampled step, never per
token.

A request's spans (docs/internals.md, "Tracing"):

- `llmserve.request`: admission to finish, a child of the caller's W3C `traceparent` (gRPC
  metadata). Its own context is stored with the request (`trace_context`), so that a scheduler
  that recovers it after a crash can link to it.
- `llmserve.queue`, `llmserve.prefill`, `llmserve.decode`: its phases (arrival to first
  scheduled, to first token, to finish), made at finish from the times the engine keeps anyway.
- `llmserve.step`: a sampled engine step (the prefill step of a traced request, or one step in
  `LLMSERVE_TRACE_STEP_EVERY`); its context goes to the executor in the `ExecuteModel`
  metadata, where the executor's `execute_model` span hangs under it. `llmserve.persist` is the
  Redis write of that step's record.
- `llmserve.recover`: on a scheduler that resumes the request from Redis, linked to the stored
  context (a span link: the original trace may have ended).

With tracing off, `ENABLED` is False and every hook returns after that one check; the
OpenTelemetry packages (the `tracing` extra) are then never imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import structlog

from scheduler_svc import envs
from scheduler_svc.core.request import req_id_of

log = structlog.get_logger(__name__)

__all__ = ["ENABLED", "setup"]

TRACEPARENT = "traceparent"
ENABLED = False  # set once by setup(); read on hot paths as the only cost when off
_tracer: Any = None
_propagator: Any = None
_step_every = 0
_num_steps = 0


def setup() -> bool:
    """Turn tracing on when the environment asks for it and the packages are there."""
    global ENABLED, _tracer, _propagator, _step_every
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
    provider = TracerProvider(
        resource=Resource.create({"service.name": envs.tracing_service_name()})
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = provider.get_tracer("llmserve.scheduler")
    _propagator = TraceContextTextMapPropagator()
    _step_every = envs.trace_step_every()
    ENABLED = True
    log.info("tracing.on", exporter=exporter_name)
    return True


def _best_effort(fallback: Any = None) -> Callable:
    """Tracing never fails a request or a step: an error inside a hook is logged (once per
    hook) and the hook returns `fallback`."""

    def wrap(hook: Callable) -> Callable:
        logged = False

        @functools.wraps(hook)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            nonlocal logged
            try:
                return hook(*args, **kwargs)
            except Exception:
                if not logged:
                    logged = True
                    log.exception("tracing.hook_failed", hook=hook.__name__)
                return fallback

        return guarded

    return wrap


def _ns(t: float) -> int:
    return int(t * 1e9)


def _context_of(traceparent: str) -> Any:
    return _propagator.extract({TRACEPARENT: traceparent}) if traceparent else None


def _traceparent_of(span: Any) -> str:
    carrier: dict[str, str] = {}
    from opentelemetry import trace

    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def incoming(metadata: Any) -> str:
    """The caller's `traceparent` from gRPC invocation metadata ("" when off or absent)."""
    if not ENABLED:
        return ""
    return next((v for k, v in metadata or () if k == TRACEPARENT), "")


@_best_effort()
def rpc_span(name: str, metadata: Any, **attributes: Any) -> Any:
    """A span for one call that stores no request (Resume, and the like) under the caller's
    context; None when off. The caller ends it (`end`)."""
    if not ENABLED:
        return None
    ctx = _context_of(incoming(metadata))
    return _tracer.start_span(name, context=ctx, attributes=attributes)


def end(span: Any) -> None:
    if span is not None:
        span.end()


# ------------------------------------------------------------------ requests


@_best_effort()
def request_started(handle: Any, parent: str) -> None:
    """Open `handle`'s request span under `parent` (a traceparent) and keep its own context on
    the handle, to be stored with the request."""
    if not ENABLED:
        return
    span = _tracer.start_span(
        "llmserve.request",
        context=_context_of(parent),
        start_time=_ns(handle.arrival_time),
        attributes={
            "llmserve.req_id": handle.req_id,
            "llmserve.num_prompt_tokens": len(handle.prompt_token_ids),
            "llmserve.n": handle.n,
        },  # fmt: skip
    )
    handle.trace_span = span
    handle.trace_context = _traceparent_of(span)


@_best_effort()
def request_recovered(handle: Any) -> None:
    """A request resumed from Redis by this scheduler: a `llmserve.recover` span linked to the
    stored context, and a new request span under it for the rest of the request's life."""
    if not ENABLED:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Link

    links = []
    stored = _context_of(handle.trace_context)
    if stored is not None:
        span_context = trace.get_current_span(stored).get_span_context()
        if span_context.is_valid:
            links.append(Link(span_context, {"llmserve.link": "original request"}))
    attributes = {"llmserve.req_id": handle.req_id, "llmserve.num_acked_tokens": handle.num_acked}
    recover = _tracer.start_span("llmserve.recover", links=links, attributes=attributes)
    span = _tracer.start_span(
        "llmserve.request",
        context=trace.set_span_in_context(recover),
        attributes={"llmserve.req_id": handle.req_id, "llmserve.recovered": True},
    )
    recover.end()
    handle.trace_span = span  # the stored context stays the original: later recoveries link there


@_best_effort()
def request_finished(handle: Any, now: float) -> None:
    """Its phases as child spans, from the times the engine kept, then the request span's end."""
    span = handle.trace_span
    if span is None:
        return
    handle.trace_span = None
    from opentelemetry import trace

    ctx = trace.set_span_in_context(span)
    start = handle.arrival_time
    scheduled = handle.scheduled_time
    first = handle.first_token_time
    phases = (
        ("llmserve.queue", start, scheduled),
        ("llmserve.prefill", scheduled, first),
        ("llmserve.decode", first, now),
    )
    for name, t0, t1 in phases:
        if t0 is not None and t1 is not None:
            _tracer.start_span(name, context=ctx, start_time=_ns(t0)).end(end_time=_ns(t1))
    reasons = [str(r) for r in handle.finish_reasons() if r is not None]
    span.set_attribute("llmserve.finish_reasons", reasons)
    span.set_attribute(
        "llmserve.num_output_tokens", sum(len(s.output_token_ids) for s in handle.states)
    )
    span.end(end_time=_ns(now))


# ------------------------------------------------------------------ steps


@_best_effort((None, None))
def step_start(out: Any, handles: Any) -> tuple[Any, Any]:
    """(gRPC metadata, span) for a step that is sampled, else (None, None): the prefill step of
    a traced request (under its request span), or one in `_step_every` (a root span)."""
    global _num_steps
    _num_steps += 1
    parent = None
    for s in out.new_seqs:
        handle = handles.get(req_id_of(s.seq_id))
        if handle is not None and handle.trace_span is not None:
            parent = handle.trace_span
            break
    if parent is None and not (_step_every and _num_steps % _step_every == 0):
        return None, None
    from opentelemetry import trace

    span = _tracer.start_span(
        "llmserve.step",
        context=trace.set_span_in_context(parent) if parent is not None else None,
        attributes={
            "llmserve.num_seqs": len(out.new_seqs) + len(out.cached_seqs),
            "llmserve.num_scheduled_tokens": out.total_num_scheduled_tokens,
        },  # fmt: skip
    )
    return ((TRACEPARENT, _traceparent_of(span)),), span


@_best_effort()
def step_done(span: Any, record: Any) -> None:
    """A sampled step came back: end its span, and time its record's Redis write (queued now,
    acknowledged later) as `llmserve.persist` under it."""
    span.end()
    if record.appends or record.finishes:
        from opentelemetry import trace

        persist = _tracer.start_span("llmserve.persist", context=trace.set_span_in_context(span))
        persist.set_attribute("llmserve.num_appends", len(record.appends))
        record.after.append(persist.end)
