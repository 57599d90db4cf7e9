"""Scheduler gRPC server: the public API plus standard health and reflection."""

from __future__ import annotations

import asyncio

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection

from protos import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.api.auth import ApiKeyInterceptor
from scheduler_svc.api.rpc_guard import MalformedRequestGuard
from scheduler_svc.api.servicer import SchedulerServicer
from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.engine.engine import Engine

log = structlog.get_logger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class SchedulerServer:
    """Owns the engine and the grpc.aio server; `start()` then `wait()`, `stop()` to drain."""

    def __init__(
        self,
        config: EngineConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_keys: dict[str, str] | None = None,
        tls: tuple[bytes, bytes] | None = None,
        reflection: bool = True,
    ) -> None:
        """`api_keys` ({key: name}): when given, the public API requires one of them.
        `tls` (certificate chain, private key) PEM: the public port speaks TLS only."""
        self.tls = tls
        self.reflection = reflection
        self.config = config
        self.api_keys = api_keys or {}
        self.host = host
        self.requested_port = port
        self.port = 0
        self.engine = Engine(config)
        self._server: grpc.aio.Server | None = None
        # The asyncio health servicer: every behaviour on this server is a coroutine.
        self._health = health.aio.HealthServicer()
        self._health_updates: set[asyncio.Task] = set()

    async def start(self) -> int:
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.api_keys:
            # First, so that a call without a key is refused before anything else looks at it.
            interceptors.append(ApiKeyInterceptor(self.api_keys, frozenset({SERVICE_NAME})))
        interceptors.append(MalformedRequestGuard(self_checked=frozenset({SERVICE_NAME})))
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(
            SchedulerServicer(self.engine.client, self.api_keys), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if self.reflection:
            grpc_reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, grpc_reflection.SERVICE_NAME), self._server
            )
        for service in ("", SERVICE_NAME):  # it starts out SERVING
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.host}:{self.requested_port}"
        if self.tls is None:
            self.port = self._server.add_insecure_port(address)
        else:
            cert, key = self.tls
            credentials = grpc.ssl_server_credentials([(key, cert)])
            self.port = self._server.add_secure_port(address, credentials)
        if self.port == 0:
            raise RuntimeError(f"could not bind {self.host}:{self.requested_port}")
        await self._server.start()
        # Serving the API before the engine is ready lets clients see UNAVAILABLE with a reason
        # rather than connection errors; health stays NOT_SERVING until an executor is up.
        await self.engine.start(on_ready_change=self._set_serving)
        log.info("scheduler.listening", host=self.host, port=self.port)
        return self.port

    def _set_serving(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        # Called from sync code (the engine's health monitor); tasks run in order of creation.
        for service in ("", SERVICE_NAME):
            task = asyncio.get_running_loop().create_task(self._health.set(service, status))
            self._health_updates.add(task)
            task.add_done_callback(self._health_updates.discard)

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float = 5.0) -> None:
        self._set_serving(False)
        await self.engine.stop(drain_timeout_s=grace_s)
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
