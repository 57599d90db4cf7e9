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

from executor_svc.api import tracing
from executor_svc.api.server import ExecutorServer
from executor_svc.config import cpus, envs, numerics
from executor_svc.config.cpus import format_cpu_list, parse_cpu_list
from executor_svc.config.logs import configure_logging
from executor_svc.config.settings import ENVIRONMENT_HELP, SECTIONS, ExecutorConfig
from executor_svc.features.flags import (
    add_feature_flags,
    feature_sections,
    feature_server_options,
    feature_usage_errors,
)

log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmserve-executor",
        description="llmserve executor: model weights, paged KV cache, one step per ExecuteModel.",
        epilog=ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # One group per section of ExecutorConfig (config/settings.py), named as the section; a
    # section of a feature's own holds the flags it declares in its folder (features/flags.py).
    for name, (_, about) in {**SECTIONS, **feature_sections()}.items():
        g = p.add_argument_group(name, about)
        if name in FLAG_GROUPS:
            FLAG_GROUPS[name](g)
        else:
            add_feature_flags(name, g)
    return p


def _model_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", default="demo", help='checkpoint directory, or "demo" (default)')
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="quantize a checkpoint's matrices at load (group-wise, 32 weights a group: int8 = "
        "Q8_0, int4 = Q4_1 with an int8 lm_head; models/quant_linear.py); CPU only",
    )
    g.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "triton", "cpu"]
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: seeded random weights of the checkpoint's shape, read from config.json "
        "alone (benchmarks of model shapes without their weights); wins over "
        "$LLMSERVE_LOAD_FORMAT, also in tensor-parallel workers",
    )
    add_feature_flags("model", g)  # the flags features declare in their folders
    g.add_argument("--max-model-len", type=int, default=None)


def _cache_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--num-device-blocks",
        type=int,
        default=None,
        help="KV cache blocks on the device (default: profile free memory)",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--swap-space", type=float, default=1.0, help="CPU swap pool size in GiB")


def _compute_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks: this process and N-1 workers it starts (gloo on "
        "the CPU, NCCL on CUDA with one device per rank); N must divide the attention heads",
    )
    g.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="step-invariant numerics (default on; env LLMSERVE_DETERMINISTIC): a sequence's "
        "logits, and so its greedy or seeded output, are bitwise the same however its tokens "
        "were batched, chunked, preempted or recovered. --no-deterministic lets the CPU matmuls "
        "pick oneDNN's kernels by shape (see README, 'Exact outputs')",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step eagerly (no CUDA graphs for decode batches; as "
        "$LLMSERVE_ENFORCE_EAGER=1)",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch intra-op threads for CPU inference (default: torch's choice); on a small "
        "host shared with the scheduler, 1 per executor avoids threads waiting on a busy core",
    )
    g.add_argument(
        "--cpu-cores",
        metavar="LIST",
        help="run this executor on these CPU cores only, e.g. 0-3,8 (Linux): its compute "
        "threads keep them to themselves when the scheduler runs on others (as vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND); without --cpu-threads, one thread per core. 'auto': one "
        "CPU per physical core of those this process may use, less the lowest core, left to "
        "the scheduler's and gRPC's Python (executor_svc/config/cpus.py). The cores "
        "are taken to be its own: every step runs on one thread, whose OpenMP workers spin "
        "between parallel regions (executor_svc/api/compute.py)",
    )


def _server_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=50061, help="0 picks a free port")
    g.add_argument(
        "--port-file",
        type=Path,
        help="write the bound port here once the executor is ready (for launchers and tests)",
    )
    g.add_argument(
        "--advertise-address",
        help="host:port schedulers should dial (default: --host:port, or this machine's "
        "address when --host is 0.0.0.0)",
    )
    g.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds in-flight calls get to finish once the server stops",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="on SIGTERM/SIGINT: seconds to keep running the sequences it holds (schedulers "
        "send it nothing new) before stopping; what is left is recomputed elsewhere. 0: stop "
        "at once. A second signal stops at once",
    )
    g.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="prefill/decode disaggregation, advertised in Describe: prefill (schedulers send "
        "it new prompts and hand each request to a decode executor after its first token), "
        "decode (it continues requests handed over with their KV; it gets new prompts only "
        "while no prefill executor is up), both (default: colocated)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics over HTTP at /metrics on this port (0: any free port; "
        "default: off)",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _tls_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--tls-cert", type=Path, help="serve TLS with this certificate chain (PEM)")
    g.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    g.add_argument(
        "--tls-ca",
        type=Path,
        help="accept only clients (schedulers) with a certificate this CA signed (mutual TLS)",
    )


def _registry_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--redis-url",
        help="register in this Redis (heartbeat) so schedulers started with "
        "--discover-executors find this executor",
    )
    g.add_argument(
        "--redis-sentinel",
        type=_sentinels,
        default=envs.redis_sentinel(),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="register in the Redis primary these Sentinels name, following it across "
        "failovers (default $LLMSERVE_REDIS_SENTINEL); --redis-url then gives only "
        "credentials, db and TLS",
    )
    g.add_argument(
        "--redis-sentinel-master",
        default=envs.redis_sentinel_master(),
        help="the primary's name in the Sentinels' configuration (default "
        "$LLMSERVE_REDIS_SENTINEL_MASTER or mymaster)",
    )


FLAG_GROUPS = {
    "model": _model_flags,
    "cache": _cache_flags,
    "compute": _compute_flags,
    "server": _server_flags,
    "tls": _tls_flags,
    "registry": _registry_flags,
}


def _sentinels(text: str) -> tuple[tuple[str, int], ...]:
    from executor_svc.api.redis_conn import parse_sentinels

    try:
        return parse_sentinels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _write_port_file(path: Path, port: int) -> None:
    # Write then rename, so a reader polling for the file never sees it empty.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    config = ExecutorConfig.from_args(parser.parse_args(argv), feature_sections())
    _check(config, parser)
    cores = _pin_cores(config.compute.cpu_cores, parser)
    configure_logging(config.server.log_level)
    if cores is not None:
        log.info("executor.cpu_cores", cores=format_cpu_list(cores), asked=config.compute.cpu_cores)
    # What the flags say over the variables, for this process's runner and kernels; rank 0
    # hands the same object to its tensor-parallel workers (runner/tp_launcher.py).
    envs.install(config.runtime)
    if config.compute.deterministic is not None:
        numerics.set_deterministic(config.compute.deterministic)
    threads = config.compute.cpu_threads or (len(cores) if cores else None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    return _serve(config, _build_server(config))


def _check(config: ExecutorConfig, parser: argparse.ArgumentParser) -> None:
    """Usage errors, each a one-line exit 2 before anything starts."""
    tls, server = config.tls, config.server
    if bool(tls.tls_cert) != bool(tls.tls_key) or (tls.tls_ca and not tls.tls_cert):
        parser.error("--tls-cert and --tls-key go together; --tls-ca needs them")
    if server.drain_timeout < 0 or server.grace < 0:
        parser.error("--drain-timeout and --grace are seconds >= 0")
    for error in feature_usage_errors(config):
        parser.error(error)
    tp_error = _tensor_parallel_error(config)
    if tp_error is not None:
        parser.error(tp_error)


def _pin_cores(cpu_cores: str | None, parser: argparse.ArgumentParser) -> set[int] | None:
    """Run this process on ``--cpu-cores`` (None: where it was started)."""
    if cpu_cores is None:
        return None
    if cpu_cores.strip() == "auto":
        cores, _ = cpus.choose()
    else:
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


def _build_server(config: ExecutorConfig) -> ExecutorServer:
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
        **feature_server_options(config),
        tls=config.tls.credentials(),
        tensor_parallel_size=config.compute.tensor_parallel_size,
        log_level=config.server.log_level,
        # Cores of its own: one OpenMP pool whose workers may spin (api/compute.py).
        compute_thread=config.compute.cpu_cores is not None,
    )
    server.install_signal_handlers(config.server.grace, config.server.drain_timeout)
    server.servicer.role = config.server.role
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
    tracing.setup()  # off unless the OTEL_* variables ask for it
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
        from executor_svc.demo.demo_model import COMMON_CONFIG, SIZES

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
