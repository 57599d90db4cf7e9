"""The frontend's own HTTP metrics (engine metrics belong to the scheduler)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match


class HTTPMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmserve_frontend_http_requests",
            "HTTP requests answered, by route and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "llmserve_frontend_http_request_duration_seconds",
            "Time to the response's start (a stream's first event), by route.",
            ["method", "route"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )

    @staticmethod
    def _route(request: Request) -> str:
        for route in request.app.routes:
            match, _ = route.matches(request.scope)
            if match == Match.FULL:
                return getattr(route, "path", "other")
        return "other"  # unknown paths share one label: no unbounded label values

    async def middleware(self, request: Request, call_next) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        route = self._route(request)
        self.latency.labels(request.method, route).observe(time.perf_counter() - start)
        self.requests.labels(request.method, route, str(response.status_code)).inc()
        return response

    def render(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
