"""The frontend's own HTTP metrics (engine metrics belong to the scheduler)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.responses import Response


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

    def asgi(self, app):
        """A plain ASGI middleware (not BaseHTTPMiddleware, which wraps `receive` and breaks
        disconnect detection): counts each response by the route that served it."""

        async def middleware(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            start = time.perf_counter()
            status = {"code": 500}

            async def send_and_note(message):
                if message["type"] == "http.response.start":
                    status["code"] = message["status"]
                    route = scope.get("route")
                    path = getattr(route, "path", "other")
                    self.latency.labels(scope["method"], path).observe(time.perf_counter() - start)
                await send(message)

            try:
                await app(scope, receive, send_and_note)
            finally:
                path = getattr(scope.get("route"), "path", "other")
                self.requests.labels(scope["method"], path, str(status["code"])).inc()

        return middleware

    def render(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
