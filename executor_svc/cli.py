"""`llmserve-executor`: serve a model (checkpoint path or "demo") over gRPC."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import structlog

from executor_svc.api.server import ExecutorServer
from executor_svc.config import envs, numerics
from executor_svc.config.logs import configure_logging
from executor_svc.config.settings import ExecutorConfig
from executor_svc.flags import build_parser

log = structlog.get_logger(__name__)


def parse_cpu_list(text: str) -> set[int]:
    """CPU ids from a list such as ``0-3,8`` (Linux's cpuset notation)."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a list of cores such as 0-3,8")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{part.strip()!r}: the range runs backwards")
        cores.update(range(first, last + 1))
    return cores


def format_cpu_list(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def _lora_config(config: ExecutorConfig, parser: argparse.ArgumentParser) -> Any:
    """The LoRA manager's configuration (``lora.manager.LoraConfig``), or None without LoRA."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    from executor_svc.lora.manager import LoraConfig

    try:
        return LoraConfig(lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras)
    except ValueError as e:
        parser.error(f"--max-loras/--max-lora-rank/--max-cpu-loras: {e}")


def _write_port_file(path: Path, port: int) -> None:
    # Write then rename, so a reader polling for the file never sees it empty.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    config = ExecutorConfig.from_args(parser.parse_args(argv))
    _check(config, parser)
    lora = _lora_config(config, parser)
    cores = _pin_cores(config.compute.cpu_cores, parser)
    configure_logging(config.server.log_level)
    # What the flags say over the variables, for this process's runner and kernels; rank 0
    # hands the same object to its tensor-parallel workers (runner/tp_launcher.py).
    envs.install(config.runtime)
    if config.compute.deterministic is not None:
        numerics.set_deterministic(config.compute.deterministic)
    threads = config.compute.cpu_threads or (len(cores) if cores else None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    return _serve(config, _build_server(config, lora))


def _check(config: ExecutorConfig, parser: argparse.ArgumentParser) -> None:
    """Usage errors, each a one-line exit 2 before anything starts."""
    tls, server = config.tls, config.server
    if bool(tls.tls_cert) != bool(tls.tls_key) or (tls.tls_ca and not tls.tls_cert):
        parser.error("--tls-cert and --tls-key go together; --tls-ca needs them")
    if server.drain_timeout < 0 or server.grace < 0:
        parser.error("--drain-timeout and --grace are seconds >= 0")
    if config.model.speculative_model and config.compute.tensor_parallel_size > 1:
        parser.error("--speculative-model does not run with --tensor-parallel-size > 1 yet")
    tp_error = _tensor_parallel_error(config)
    if tp_error is not None:
        parser.error(tp_error)


def _pin_cores(cpu_cores: str | None, parser: argparse.ArgumentParser) -> set[int] | None:
    """Run this process on ``--cpu-cores`` (None: where it was started)."""
    if cpu_cores is None:
        return None
    try:
        cores = parse_cpu_list(cpu_cores)
    except ValueError as e:
        parser.error(f"--cpu-cores: {e}")
    online = set(range(os.cpu_count() or 1))
    if not cores <= online:
        parser.error(
            f"--cpu-cores: {format_cpu_list(cores - online)} not available to this process "
            f"(this machine has {format_cpu_list(online)})"
        )
    try:
        # Every thread there is now (the calling one alone sets only itself), and every
        # thread started later (torch's, gRPC's, the tensor-parallel workers') inherits
        # the set. It may leave the set this process was started with (taskset).
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), cores)
    except OSError as e:  # a container's cpuset without those cores
        parser.error(f"--cpu-cores: cannot run on {format_cpu_list(cores)}: {e}")
    return cores


def _build_server(config: ExecutorConfig, lora: Any) -> ExecutorServer:
    model, cache = config.model, config.cache
    server = ExecutorServer(
        model.model,
        config.server.host,
        config.server.port,
        device=model.device,
        dtype=model.dtype,
        block_size=cache.block_size,
        num_device_blocks=cache.num_device_blocks,
        gpu_memory_utilization=cache.gpu_memory_utilization,
        swap_space_gib=cache.swap_space,
        max_model_len=model.max_model_len,
        attention_backend=model.attention_backend,
        **({"quantization": model.quantization} if model.quantization else {}),
        **({"speculative_model": model.speculative_model} if model.speculative_model else {}),
        tls=config.tls.credentials(),
        tensor_parallel_size=config.compute.tensor_parallel_size,
        log_level=config.server.log_level,
        **({"lora": lora} if lora is not None else {}),
    )
    server.install_signal_handlers(config.server.grace, config.server.drain_timeout)
    if config.server.metrics_port is not None:
        from executor_svc.api.metrics import ExecutorMetrics, serve_metrics

        metrics = ExecutorMetrics(server.servicer)
        server.servicer.on_step = metrics.observe_step
        metrics_port = serve_metrics(metrics, config.server.host, config.server.metrics_port)
        log.info("metrics.listening", host=config.server.host, port=metrics_port)
    return server


def _serve(config: ExecutorConfig, server: ExecutorServer) -> int:
    """Bind, load, register, and serve until stopped; the process's exit code."""
    host, model = config.server.host, config.model.model
    try:
        port = server.start()
    except OSError as e:
        log.error("executor.bind_failed", host=host, port=config.server.port, error=str(e))
        return 1
    print(f"llmserve-executor listening on {host}:{port}", flush=True)
    try:
        server.load()
    except Exception as e:
        log.exception("executor.load_failed", model=str(model))
        print(f"llmserve-executor: could not load {model}: {e}", file=sys.stderr)
        server.stop(0)
        return 1
    runner = server.servicer.loaded_runner
    log_numerics(runner.device.type if runner is not None else "cpu")
    registration = _register(config, server, port) if config.registry.enabled else None
    if config.server.port_file is not None:
        _write_port_file(config.server.port_file, port)
    try:
        server.wait()
    finally:
        if registration is not None:
            registration.stop()
    return 0


def _register(config: ExecutorConfig, server: ExecutorServer, port: int) -> Any:
    from executor_svc.api.registry import ExecutorRegistration

    reg = config.registry
    address = config.server.advertise_address or advertised_address(config.server.host, port)
    registration = ExecutorRegistration(
        reg.redis_url,
        server.servicer.instance_id,
        address,
        sentinels=reg.redis_sentinel or (),
        sentinel_master=reg.redis_sentinel_master,
        sentinel_password=reg.redis_sentinel_password,
    )
    registration.start()
    log.info("executor.registered", address=address, healthy=registration.healthy)
    return registration


def log_numerics(device_type: str = "cpu") -> None:
    """Say at start-up whether outputs are step-invariant here, and why not when they are not."""
    from executor_svc.kernels import library

    if not numerics.deterministic():
        log.info("executor.numerics", deterministic=False, note="--no-deterministic")
    elif device_type == "cuda" and envs.cuda_invariant():
        log.info(
            "executor.numerics",
            deterministic=True,
            step_invariant=True,
            note="LLMSERVE_CUDA_INVARIANT=1: Triton GEMMs, fixed-tile attention and row-order "
            "sampler reductions (tested in fp32 on an H200; ~0.6x the default's throughput)",
        )
    elif device_type == "cuda":
        log.warning(
            "executor.numerics",
            deterministic=True,
            step_invariant=False,
            reason="CUDA: cuBLAS and the Triton attention's context split choose their "
            "reduction order by the step's shape (measured: logits differ by ~1e-5 between "
            "groupings); LLMSERVE_CUDA_INVARIANT=1 makes it step-invariant at ~0.6x the speed",
        )
    elif not library.available():
        log.warning(
            "executor.numerics",
            deterministic=True,
            step_invariant=False,
            reason="no compiled CPU kernels (no C++ compiler): matmuls go to oneDNN/MKL",
        )
    else:
        log.info("executor.numerics", deterministic=True, step_invariant=True)


def _tensor_parallel_error(config: ExecutorConfig) -> str | None:
    """A usage error for a --tensor-parallel-size the model or the machine cannot take (checked
    before the port opens; a model that cannot be read is reported by the load as before)."""
    world_size, model = config.compute.tensor_parallel_size, config.model.model
    if world_size == 1:
        return None
    from executor_svc.runner.tp_launcher import tensor_parallel_error

    if str(model) == "demo":
        from executor_svc.tools.demo_model import COMMON_CONFIG, SIZES

        hf_config = {**COMMON_CONFIG, **SIZES["demo"]}
    else:
        try:
            hf_config = json.loads((Path(model).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            hf_config = None
    if hf_config is None:
        return None if world_size > 1 else "--tensor-parallel-size must be >= 1"
    return tensor_parallel_error(hf_config, world_size, config.model.device)


def advertised_address(host: str, port: int) -> str:
    """Where other machines reach this executor: the bind host, unless it binds everything."""
    if host in ("0.0.0.0", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


if __name__ == "__main__":
    sys.exit(main())
