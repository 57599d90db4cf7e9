"""Prometheus metrics of the executor (`--metrics-port`): step durations and where they go.

Per step the servicer observes one histogram value; the model runner adds the seconds of each
phase (cache operations, forward, sampling) to plain counters that the collector reads at
scrape time. On CUDA the forward is launched asynchronously and the sampler's copy to the host
waits for it, so there the forward's GPU time shows up under sampling.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from executor_svc.api.service import ExecutorServicer

__all__ = ["ExecutorMetrics", "serve_metrics"]

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ExecutorMetrics:
    def __init__(self, servicer: ExecutorServicer) -> None:
        self.servicer = servicer
        self.registry = CollectorRegistry(auto_describe=False)
        self.step_duration = Histogram(
            "llmserve:executor_step_duration_seconds",
            "ExecuteModel wall time: validation, cache operations, forward, sampling.",
            labelnames=["model_name"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(self)

    def observe_step(self, seconds: float) -> None:
        self.step_duration.labels(self.servicer.model_name).observe(seconds)

    def collect(self) -> Iterator[Metric]:
        servicer = self.servicer
        runner = servicer.loaded_runner
        labels = ["model_name"]
        values = [servicer.model_name]
        live = GaugeMetricFamily(
            "llmserve:executor_live_sequences", "Sequences held by this executor.", labels=labels
        )
        live.add_metric(values, servicer.num_live_sequences if runner is not None else 0)
        yield live
        if runner is None:
            return
        blocks = GaugeMetricFamily(
            "llmserve:executor_num_device_blocks",
            "KV cache blocks on the device.",
            labels=labels,
        )
        blocks.add_metric(values, runner.num_device_blocks)
        yield blocks
        phases = CounterMetricFamily(
            "llmserve:executor_phase_seconds",
            "Seconds spent per step phase (cache_ops, forward, sampling; on CUDA also wait: the "
            "host waiting for draws, and gpu: each step's span on the device).",
            labels=[*labels, "phase"],
        )
        for phase, seconds in runner.phase_seconds.items():
            phases.add_metric([*values, phase], seconds)
        yield phases


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 -- stdlib name
        pass  # one line per scrape would flood the log


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve_metrics(metrics: ExecutorMetrics, host: str, port: int) -> int:
    """Serve /metrics over HTTP on a daemon thread; returns the bound port (port 0: any).

    Always the classic text format: prometheus_client (0.26) writes OpenMetrics sample names
    with `:` turned into `_` (llmserve_generation_tokens_total under a llmserve:... family), and
    Prometheus asks for OpenMetrics when it can, so dashboards would not find vLLM's names.
    Dropping the Accept header makes it answer in the format that keeps them.
    """
    app = make_wsgi_app(metrics.registry)

    def classic(environ: dict, start_response: Callable) -> Iterable[bytes]:
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    server = make_server(host, port, classic, _ThreadingServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return int(server.server_port)
