"""`llmserve-executor`: serve a model (checkpoint path or "demo") over gRPC."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import structlog

from executor_svc.api.server import ExecutorServer
from executor_svc.config import envs, numerics
from executor_svc.config.logs import configure_logging

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmserve-executor",
        description="llmserve executor: model weights, paged KV cache, one step per ExecuteModel.",
    )
    p.add_argument("--model", default="demo", help='checkpoint directory, or "demo" (default)')
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061, help="0 picks a free port")
    p.add_argument(
        "--port-file",
        type=Path,
        help="write the bound port here once the executor is ready (for launchers and tests)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-device-blocks",
        type=int,
        default=None,
        help="KV cache blocks on the device (default: profile free memory)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--swap-space", type=float, default=1.0, help="CPU swap pool size in GiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="quantize a checkpoint's matrices at load (group-wise, 32 weights a group: int8 = "
        "Q8_0, int4 = Q4_1 with an int8 lm_head; models/quant_linear.py); CPU only",
    )
    p.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "triton", "cpu"]
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: seeded random weights of the checkpoint's shape, read from config.json "
        "alone (benchmarks of model shapes without their weights)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step eagerly (no CUDA graphs for decode batches)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N ranks: this process and N-1 workers it starts (gloo on "
        "the CPU, NCCL on CUDA with one device per rank); N must divide the attention heads",
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="step-invariant numerics (default on; env LLMSERVE_DETERMINISTIC): a sequence's "
        "logits, and so its greedy or seeded output, are bitwise the same however its tokens "
        "were batched, chunked, preempted or recovered. --no-deterministic lets the CPU matmuls "
        "pick oneDNN's kernels by shape (see README, 'Exact outputs')",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch intra-op threads for CPU inference (default: torch's choice); on a small "
        "host shared with the scheduler, 1 per executor avoids threads waiting on a busy core",
    )
    p.add_argument(
        "--cpu-cores",
        metavar="LIST",
        help="run this executor on these CPU cores only, e.g. 0-3,8 (Linux): its compute "
        "threads keep them to themselves when the scheduler runs on others (as vLLM's "
        "VLLM_CPU_OMP_THREADS_BIND); without --cpu-threads, one thread per core",
    )
    p.add_argument(
        "--redis-url",
        help="register in this Redis (heartbeat) so schedulers started with "
        "--discover-executors find this executor",
    )
    p.add_argument(
        "--redis-sentinel",
        type=_sentinels,
        default=envs.redis_sentinel(),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="register in the Redis primary these Sentinels name, following it across "
        "failovers (default $LLMSERVE_REDIS_SENTINEL); --redis-url then gives only "
        "credentials, db and TLS",
    )
    p.add_argument(
        "--redis-sentinel-master",
        default=envs.redis_sentinel_master(),
        help="the primary's name in the Sentinels' configuration (default "
        "$LLMSERVE_REDIS_SENTINEL_MASTER or mymaster)",
    )
    p.add_argument(
        "--advertise-address",
        help="host:port schedulers should dial (default: --host:port, or this machine's "
        "address when --host is 0.0.0.0)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds in-flight calls get to finish once the server stops",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="on SIGTERM/SIGINT: seconds to keep running the sequences it holds (schedulers "
        "send it nothing new) before stopping; what is left is recomputed elsewhere. 0: stop "
        "at once. A second signal stops at once",
    )
    p.add_argument(
        "--speculative-model",
        default=None,
        help="a draft checkpoint (same tokenizer, fewer layers) for the scheduler's "
        '--speculative-config \'{"method": "draft_model", ...}\'; not with TP > 1',
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--tls-cert", type=Path, help="serve TLS with this certificate chain (PEM)")
    p.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    p.add_argument(
        "--tls-ca",
        type=Path,
        help="accept only clients (schedulers) with a certificate this CA signed (mutual TLS)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (the scheduler names each sequence's PEFT directory)",
    )
    p.add_argument("--max-loras", type=int, default=4, help="distinct adapters in one step")
    p.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank")
    p.add_argument(
        "--max-cpu-loras", type=int, default=16, help="adapters kept loaded on the host (LRU)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics over HTTP at /metrics on this port (0: any free port; "
        "default: off)",
    )
    return p


def _lora_kwargs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    if not args.enable_lora:
        return {}
    from executor_svc.features.lora.manager import LoraConfig

    try:
        return {"lora": LoraConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)}
    except ValueError as e:
        parser.error(f"--max-loras/--max-lora-rank/--max-cpu-loras: {e}")


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
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_ca and not args.tls_cert):
        parser.error("--tls-cert and --tls-key go together; --tls-ca needs them")
    if args.drain_timeout < 0 or args.grace < 0:
        parser.error("--drain-timeout and --grace are seconds >= 0")
    tls = None
    if args.tls_cert:
        ca = args.tls_ca.read_bytes() if args.tls_ca else None
        tls = (args.tls_cert.read_bytes(), args.tls_key.read_bytes(), ca)
    if args.speculative_model and args.tensor_parallel_size > 1:
        parser.error("--speculative-model does not run with --tensor-parallel-size > 1 yet")
    tp_error = _tensor_parallel_error(args)
    if tp_error is not None:
        parser.error(tp_error)
    cores = None
    if args.cpu_cores is not None:
        try:
            cores = parse_cpu_list(args.cpu_cores)
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
    configure_logging(args.log_level)
    # Read by the runner through config.envs, as tensor-parallel workers (processes of their
    # own) read them from the environment they inherit.
    os.environ["LLMSERVE_LOAD_FORMAT"] = args.load_format
    if args.enforce_eager:
        os.environ["LLMSERVE_ENFORCE_EAGER"] = "1"
    if args.deterministic is not None:
        numerics.set_deterministic(args.deterministic)
        # Tensor-parallel workers are processes of their own: they read the environment.
        envs.export_deterministic(args.deterministic)
    threads = args.cpu_threads or (len(cores) if cores else None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    server = ExecutorServer(
        args.model,
        args.host,
        args.port,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_device_blocks=args.num_device_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space_gib=args.swap_space,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        **({"quantization": args.quantization} if args.quantization else {}),
        **({"speculative_model": args.speculative_model} if args.speculative_model else {}),
        tls=tls,
        tensor_parallel_size=args.tensor_parallel_size,
        log_level=args.log_level,
        **_lora_kwargs(args, parser),
    )
    server.install_signal_handlers(args.grace, args.drain_timeout)
    if args.metrics_port is not None:
        from executor_svc.api.metrics import ExecutorMetrics, serve_metrics

        metrics = ExecutorMetrics(server.servicer)
        server.servicer.on_step = metrics.observe_step
        metrics_port = serve_metrics(metrics, args.host, args.metrics_port)
        log.info("metrics.listening", host=args.host, port=metrics_port)
    try:
        port = server.start()
    except OSError as e:
        log.error("executor.bind_failed", host=args.host, port=args.port, error=str(e))
        return 1
    print(f"llmserve-executor listening on {args.host}:{port}", flush=True)
    try:
        server.load()
    except Exception as e:
        log.exception("executor.load_failed", model=str(args.model))
        print(f"llmserve-executor: could not load {args.model}: {e}", file=sys.stderr)
        server.stop(0)
        return 1
    runner = server.servicer.loaded_runner
    log_numerics(runner.device.type if runner is not None else "cpu")
    registration = None
    if args.redis_url or args.redis_sentinel:
        from executor_svc.api.registry import ExecutorRegistration

        address = args.advertise_address or advertised_address(args.host, port)
        registration = ExecutorRegistration(
            args.redis_url,
            server.servicer.instance_id,
            address,
            sentinels=args.redis_sentinel or (),
            sentinel_master=args.redis_sentinel_master,
            sentinel_password=envs.redis_sentinel_password(),
        )
        registration.start()
        log.info("executor.registered", address=address, healthy=registration.healthy)
    if args.port_file is not None:
        _write_port_file(args.port_file, port)
    try:
        server.wait()
    finally:
        if registration is not None:
            registration.stop()
    return 0


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


def _tensor_parallel_error(args: argparse.Namespace) -> str | None:
    """A usage error for a --tensor-parallel-size the model or the machine cannot take (checked
    before the port opens; a model that cannot be read is reported by the load as before)."""
    if args.tensor_parallel_size == 1:
        return None
    from executor_svc.runner.tp_launcher import tensor_parallel_error

    if str(args.model) == "demo":
        from executor_svc.tools.demo_model import COMMON_CONFIG, SIZES

        config = {**COMMON_CONFIG, **SIZES["demo"]}
    else:
        try:
            config = json.loads((Path(args.model).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            config = None
    if config is None:
        return None if args.tensor_parallel_size > 1 else "--tensor-parallel-size must be >= 1"
    return tensor_parallel_error(config, args.tensor_parallel_size, args.device)


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
