"""The executor's gRPC server: Executor servicer, grpc.health.v1 health and server reflection.

The port is bound and health answers NOT_SERVING before the model is loaded, so a launcher can
watch the executor come up; health flips to SERVING once the weights and the KV cache exist.
"""

from __future__ import annotations

import gc
import json
import signal
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_svc.api.compute import ComputeThread
from executor_svc.api.service import ExecutorServicer
from protos import executor_pb2, executor_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
DEMO_MODEL = "demo"


def resolve_model(model: str | Path) -> tuple[Path, str]:
    """The checkpoint directory and the name Describe reports for it."""
    if str(model) == DEMO_MODEL:
        # Built once into $LLMSERVE_CACHE (or ~/.cache/llmserve) and reused afterwards.
        from executor_svc.demo.demo_model import ensure_demo_model

        return ensure_demo_model(), DEMO_MODEL
    path = Path(model).expanduser()
    from executor_svc.features.gguf import hf_files, reader

    gguf_path = reader.find_gguf(path)
    if gguf_path is not None:  # the side directory transformers builds from its metadata
        return hf_files.prepare(gguf_path), gguf_path.stem
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face checkpoint (no config.json)")
    return path, path.resolve().name


class ExecutorServer:
    """One executor process's server. `start()` binds, `load()` builds the model and turns
    SERVING, `stop()` drains in-flight steps for a grace period."""

    def __init__(
        self,
        model: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_workers: int = 8,
        tls: tuple[bytes, bytes, bytes | None] | None = None,
        tensor_parallel_size: int = 1,
        log_level: str = "info",
        compute_thread: bool = False,
        **runner_kwargs: Any,
    ) -> None:
        """`tls`: (certificate chain, private key, client CA) PEM; with a client CA only
        clients holding a certificate it signed get through (mutual TLS).
        `tensor_parallel_size` > 1: this process is rank 0 and `load()` starts the other
        ranks (from the calling thread, which must outlive them: they die with it).
        `compute_thread`: on a CPU, load and run every step on one thread (api/compute.py; the
        CLI asks for it when the executor has cores of its own, `--cpu-cores`)."""
        self.tls = tls
        self.tensor_parallel_size = tensor_parallel_size
        self.log_level = log_level
        self.tp_workers: Any = None  # runner.tp_launcher.TPWorkers once started
        self.model = model
        self.host = host
        self.requested_port = port
        self.runner_kwargs = runner_kwargs
        self.servicer = ExecutorServicer(peer_tls=tls)
        # A CPU executor on cores of its own loads and steps on one thread (api/compute.py).
        self.compute_thread = compute_thread
        self.compute: ComputeThread | None = None
        self.health = health.HealthServicer()
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # gRPC sets SO_REUSEPORT by default, which would let a second executor bind a busy
            # port and silently split the traffic; a clash must fail instead.
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="executor-rpc"),
            options=options,
        )
        executor_pb2_grpc.add_ExecutorServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.port = 0
        self._stopped = threading.Event()
        self._stop_done = threading.Event()

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> int:
        """Bind and start answering (health NOT_SERVING); returns the bound port."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.host}:{self.requested_port}"
        if self.tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            cert, key, client_ca = self.tls
            credentials = grpc.ssl_server_credentials(
                [(key, cert)],
                root_certificates=client_ca,
                require_client_auth=client_ca is not None,
            )
            self.port = self.server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"could not bind {self.host}:{self.requested_port}")
        self.server.start()
        log.info("executor.listening", host=self.host, port=self.port)
        return self.port

    def load(self) -> None:
        """Build the model runner (weights + KV cache), then report SERVING. With
        `compute_thread` on a CPU, built on the compute thread, which then runs every step."""
        from executor_svc.runner.loader import resolve_device

        device = resolve_device(self.runner_kwargs.get("device", "auto"))
        if self.compute_thread and device.type == "cpu":
            self.compute = ComputeThread()
            self.servicer.compute = self.compute.run
            self.compute.run(self._load)
        else:
            self._load()

    def _load(self) -> None:
        from executor_svc.runner.model_runner import ModelRunner

        model_dir, model_name = resolve_model(self.model)
        kwargs, tp = self.runner_kwargs, None
        if self.tensor_parallel_size > 1:
            from executor_svc.runner.tp_launcher import TPWorkers, tensor_parallel_error

            config = json.loads((model_dir / "config.json").read_text())
            error = tensor_parallel_error(
                config, self.tensor_parallel_size, kwargs.get("device", "auto")
            )
            if error is not None:
                raise ValueError(error)
            self.tp_workers = TPWorkers(
                self.tensor_parallel_size, model_dir, kwargs, log_level=self.log_level
            )
            tp = self.tp_workers.start()
            kwargs = {**kwargs, "device": str(tp.device)}
        runner = ModelRunner(model_dir, tp=tp, **kwargs)
        self.servicer.attach(runner, model_dir=model_dir, model_name=model_name)
        # Loading left the process's long-lived objects (modules, weights' wrappers, imported
        # libraries) in the collector's oldest generation, where every full collection walked
        # them again (the scheduler does the same after its start-up, engine.py). Frozen, they
        # are skipped; the steps' own garbage is still collected.
        gc.collect()
        gc.freeze()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        info = runner.info
        log.info(
            "executor.ready",
            port=self.port,
            model=model_name,
            architecture=str(info.architecture),
            device=str(info.device),
            dtype=info.dtype_name,
            block_size=runner.block_size,
            num_device_blocks=runner.num_device_blocks,
            num_cpu_blocks=runner.num_cpu_blocks,
            tensor_parallel_size=info.tensor_parallel_size,
            instance_id=self.servicer.instance_id,
        )

    def stop(self, grace: float | None = 5.0) -> None:
        """Stop taking calls; in-flight ones get `grace` seconds to finish."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.servicer.close_kv_transfer()
        if self.tp_workers is not None:
            self.tp_workers.stop(self.servicer.step_lock)
        if self.compute is not None:
            self.compute.close()
        log.info("executor.stopped")
        self._stop_done.set()

    def drain(self, timeout: float, grace: float = 5.0, idle_s: float = 2.0) -> None:
        """Graceful shutdown: say `draining` (Describe and every step reply, so schedulers
        send nothing new and move what has not started), keep running steps until no sequence
        is left or `timeout` passes, then stop. Schedulers recompute what is left elsewhere.

        Sequences that no scheduler steps for `idle_s` (it stopped first, or dropped them) are
        not waited for."""
        servicer = self.servicer
        servicer.draining = True
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        left = servicer.num_live_sequences
        log.info("executor.draining", sequences=left, timeout_s=timeout)
        start = time.monotonic()
        while left and not self._stopped.is_set():
            now = time.monotonic()
            if now - start >= timeout:
                break
            if now - max(start, servicer.last_step_time) >= idle_s:
                log.info("executor.drain.no_scheduler", idle_s=idle_s)
                break
            time.sleep(0.05)
            left = servicer.num_live_sequences
        log.info("executor.drained", sequences_left=left)
        self.stop(grace)

    def wait(self) -> None:
        """Until `stop()` has finished (tensor-parallel workers reaped included)."""
        self.server.wait_for_termination()
        self._stop_done.wait()

    def install_signal_handlers(self, grace: float = 5.0, drain_timeout: float = 0.0) -> None:
        """SIGTERM/SIGINT shut down gracefully (main thread only): drain for up to
        `drain_timeout` seconds, then stop with `grace`; a second signal stops at once."""
        signals = 0

        def handler(signum: int, frame: object) -> None:
            nonlocal signals
            signals += 1
            log.info("executor.signal", signal=signal.Signals(signum).name)
            if signals == 1 and drain_timeout > 0 and self.servicer.loaded_runner is not None:
                target, args = self.drain, (drain_timeout, grace)
            else:
                target, args = self.stop, (grace if signals == 1 else 0,)
            # From another thread: stopping waits, and signal handlers must return.
            threading.Thread(target=target, args=args, daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def serve(
    model: str | Path, host: str = "127.0.0.1", port: int = 0, **runner_kwargs: Any
) -> tuple[grpc.Server, int]:
    """Start a ready executor (model loaded, health SERVING); returns the server and its port.

    Stop it with `server.stop(grace)`.
    """
    srv = ExecutorServer(model, host, port, **runner_kwargs)
    bound = srv.start()
    try:
        srv.load()
    except BaseException:
        srv.server.stop(None)
        raise
    return srv.server, bound
