"""OpenTelemetry traces across the services (issue 46), checked at a real OTLP receiver: a gRPC
TraceService built here from `opentelemetry-proto`, on loopback, that keeps every span the
frontend, the scheduler and the executor export.

- One request through the frontend, sent with a W3C `traceparent`: its spans in all three
  services are in that trace, each under the right parent.
- A request under way when the scheduler is killed -9: the restarted scheduler's (or the
  standby's that takes over) `llmserve.recover` span links to the request's original trace.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import openai
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import (  # noqa: E402
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from scheduler_svc.local.redis_server import RedisServer  # noqa: E402
from tests.support.frontend import Frontend  # noqa: E402
from tests.support.stack import Stack, make_stack, tiny_model_dir  # noqa: E402
from tests.support.standby import Scheduler  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects (service name, span) of every export."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the proto's name
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((attrs.get("service.name", ""), s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def find(self, name: str, trace_id: str | None = None) -> list[tuple[str, object]]:
        with self._lock:
            return [
                (svc, s)
                for svc, s in self.spans
                if s.name == name and (trace_id is None or s.trace_id.hex() == trace_id)
            ]

    def wait(self, what: Callable[[], list], timeout: float = 60.0) -> list:
        deadline = time.monotonic() + timeout
        while not (found := what()):
            assert time.monotonic() < deadline, sorted({s.name for _, s in self.spans})
            time.sleep(0.1)
        return found


@pytest.fixture(scope="module")
def receiver():
    """One receiver for the module: each test finds its spans by its own trace id."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.MonkeyPatch.context() as monkeypatch:
            # Read by each service's config module (OTEL_EXPORTER_OTLP_ENDPOINT turns tracing
            # on) and by the SDK (a short export delay keeps the test short).
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
            monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
            monkeypatch.setenv("LLMSERVE_TRACE_STEP_EVERY", "0")  # only the traced requests' steps
            yield receiver
    finally:
        server.stop(None)


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory, receiver):
    """One stack for the module: the first tests only send requests, and the last one to use
    it restarts its scheduler (as the stack's own `start_scheduler` does)."""
    tmp_path = tmp_path_factory.mktemp("traced")
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    (tmp_path / "w").mkdir()
    stack = make_stack(tmp_path / "w", redis)
    fe = Frontend.start(tmp_path / "fe", stack.address, "--resume-timeout", "120")
    try:
        fe.wait_healthy()
        yield receiver, stack, fe
    finally:
        fe.stop()
        stack.stop()
        redis.close()


def _one(spans: list[tuple[str, object]]) -> tuple[str, object]:
    assert len(spans) == 1, [s.name for _, s in spans]
    return spans[0]


def test_one_request_is_one_trace_from_frontend_to_executor(traced_stack):
    receiver, stack, fe = traced_stack
    traceparent = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
    body = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}
    status, out = fe.request("POST", "/v1/completions", body, {"traceparent": traceparent})
    assert status == 200, out

    def in_trace(name: str) -> Callable[[], list]:
        return lambda: receiver.find(name, TRACE_ID)

    svc, http = _one(receiver.wait(in_trace("POST /v1/completions")))
    assert svc == "llmserve-frontend"
    assert http.parent_span_id.hex() == CALLER_SPAN_ID
    svc, request = _one(receiver.wait(in_trace("llmserve.request")))
    assert svc == "llmserve-scheduler"
    assert request.parent_span_id == http.span_id
    for phase in ("llmserve.queue", "llmserve.prefill", "llmserve.decode"):
        _, span = _one(receiver.wait(in_trace(phase)))
        assert span.parent_span_id == request.span_id, phase
        assert request.start_time_unix_nano <= span.start_time_unix_nano
        assert span.end_time_unix_nano <= request.end_time_unix_nano
    steps = receiver.wait(in_trace("llmserve.step"))
    assert all(s.parent_span_id == request.span_id for _, s in steps)
    svc, executed = receiver.wait(in_trace("execute_model"))[0]
    assert svc == "llmserve-executor"
    assert executed.parent_span_id in {s.span_id for _, s in steps}
    _, persist = receiver.wait(in_trace("llmserve.persist"))[0]
    assert persist.parent_span_id in {s.span_id for _, s in steps}
    # Sampled per request phase and per step, never per token.
    assert len(receiver.find("llmserve.decode", TRACE_ID)) == 1


def test_an_embedding_call_is_traced_into_the_scheduler(traced_stack):
    receiver, stack, fe = traced_stack
    trace_id = "7a7a7a7a7a7a4a7a8a7a7a7a7a7a7a7a"
    headers = {"traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"}
    status, out = fe.request("POST", "/v1/embeddings", {"input": ["a cat", "a dog"]}, headers)
    assert status == 200, out
    _, http = _one(receiver.wait(lambda: receiver.find("POST /v1/embeddings", trace_id)))
    svc, embed = _one(receiver.wait(lambda: receiver.find("llmserve.embed", trace_id)))
    assert svc == "llmserve-scheduler"
    assert embed.parent_span_id == http.span_id


def _stream_across_a_kill(fe: Frontend, trace_id: str, kill: Callable[[], None]) -> None:
    """A long greedy stream sent with `trace_id`; `kill()` once it is under way; it must end
    normally (the frontend resumes it)."""
    oai = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="unused", max_retries=0, timeout=180)
    model = oai.models.list().data[0].id
    progress: list[str] = []
    finishes: list[str] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            stream = oai.completions.create(
                model=model,
                prompt="A long story:",
                max_tokens=200,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
                extra_headers={"traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"},
            )
            for chunk in stream:
                progress.extend(c.text for c in chunk.choices)
                finishes.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while len(progress) < 4:
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.01)
    kill()
    thread.join(timeout=180)
    assert not errors, errors
    assert finishes == ["length"]  # the stream went on to its end after the crash


def _assert_recovery_linked(receiver: Receiver, trace_id: str) -> None:
    def linked() -> list:
        return [
            (svc, s)
            for svc, s in receiver.find("llmserve.recover")
            if any(link.trace_id.hex() == trace_id for link in s.links)
        ]

    svc, recover = _one(receiver.wait(linked))
    assert svc == "llmserve-scheduler"
    assert recover.trace_id.hex() != trace_id  # a trace of its own, linked to the original
    # The resumed request's new request span hangs under the recovery span, and finishes.
    resumed = receiver.wait(
        lambda: [
            s
            for _, s in receiver.find("llmserve.request", recover.trace_id.hex())
            if s.parent_span_id == recover.span_id
        ]
    )
    assert len(resumed) == 1
    # The frontend's HTTP span of the request is in the original trace.
    assert receiver.wait(lambda: receiver.find("POST /v1/completions", trace_id))


def test_recovery_span_links_to_the_original_trace(traced_stack):
    receiver, stack, fe = traced_stack
    trace_id = "0af7651916cd43dd8448eb211c80319c"

    def restart() -> None:
        stack.kill_scheduler()
        stack.start_scheduler()

    _stream_across_a_kill(fe, trace_id, restart)
    _assert_recovery_linked(receiver, trace_id)


def test_a_standby_taking_over_links_its_recovery_to_the_original_trace(tmp_path, receiver):
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    stack = Stack(
        workdir=tmp_path,
        model_dir=tiny_model_dir(tmp_path.parent / "models"),
        redis=redis,
        executor_args=["--num-device-blocks", "512", "--swap-space", "0.05"],
    )
    stack.start_executor()
    schedulers: list[Scheduler] = []
    fe = None
    try:
        leader = Scheduler(tmp_path / "a", stack.executor_address, redis.url)
        schedulers.append(leader)
        leader.wait_serving(60)
        schedulers.append(Scheduler(tmp_path / "b", stack.executor_address, redis.url))
        addresses = ",".join(s.address for s in schedulers)
        fe = Frontend.start(tmp_path / "fe", addresses, "--resume-timeout", "120")
        fe.wait_healthy()
        trace_id = "5e5e5e5e5e5e4e5e8e5e5e5e5e5e5e5e"
        _stream_across_a_kill(fe, trace_id, lambda: leader.proc.send_signal(signal.SIGKILL))
        _assert_recovery_linked(receiver, trace_id)
    finally:
        if fe is not None:
            fe.stop()
        for s in schedulers:
            s.stop()
        stack.stop()
        redis.close()
