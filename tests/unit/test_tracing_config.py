"""Tracing is off unless the standard OTEL_* variables ask for it, by the same rule in each
service's config module; off, the tracing modules create nothing."""

from __future__ import annotations

import pytest

from executor_svc.api import tracing as executor_tracing
from executor_svc.config import envs as executor_envs
from frontend_svc import config as frontend_config
from frontend_svc import tracing as frontend_tracing
from scheduler_svc import envs as scheduler_envs
from scheduler_svc import tracing as scheduler_tracing

RULES = [scheduler_envs.tracing_exporter, executor_envs.tracing_exporter,
         frontend_config.tracing_exporter]  # fmt: skip
VARIABLES = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, "otlp"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, None),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, None),
    ],
)
def test_each_service_reads_the_same_rule(monkeypatch, env, want):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert [rule() for rule in RULES] == [want] * len(RULES)


def test_off_by_default_creates_nothing():
    assert scheduler_tracing.setup() is False and not scheduler_tracing.ENABLED
    assert executor_tracing.setup() is False and not executor_tracing.ENABLED
    assert frontend_tracing.setup(None, "x") is False and not frontend_tracing.ENABLED
    assert frontend_tracing.client_interceptors() == []
    app = object()
    assert frontend_tracing.asgi(app) is app
    assert (
        scheduler_tracing.incoming([("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")])
        == ""
    )
    assert scheduler_tracing.rpc_span("llmserve.resume", []) is None
