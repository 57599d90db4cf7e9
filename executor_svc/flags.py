"""The executor's command line: its flags in one group per section of ``ExecutorConfig``
(``config/settings.py``), as ``--help`` shows them, and the environment variables beside them
(``config/envs.py``, the only module of the executor that reads the environment)."""

from __future__ import annotations

import argparse
from pathlib import Path

from executor_svc.config import envs
from executor_svc.config.settings import ENVIRONMENT_HELP, SECTIONS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmserve-executor",
        description="llmserve executor: model weights, paged KV cache, one step per ExecuteModel.",
        epilog=ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # One group per section of ExecutorConfig (config/settings.py), named as the section.
    for name, (_, about) in SECTIONS.items():
        FLAG_GROUPS[name](p.add_argument_group(name, about))
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
    g.add_argument(
        "--speculative-model",
        default=None,
        help="a draft checkpoint (same tokenizer, fewer layers) for the scheduler's "
        '--speculative-config \'{"method": "draft_model", ...}\'; not with TP > 1',
    )
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
        "VLLM_CPU_OMP_THREADS_BIND); without --cpu-threads, one thread per core",
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


def _lora_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (the scheduler names each sequence's PEFT directory)",
    )
    g.add_argument("--max-loras", type=int, default=4, help="distinct adapters in one step")
    g.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank")
    g.add_argument(
        "--max-cpu-loras", type=int, default=16, help="adapters kept loaded on the host (LRU)"
    )


FLAG_GROUPS = {
    "model": _model_flags,
    "cache": _cache_flags,
    "compute": _compute_flags,
    "server": _server_flags,
    "tls": _tls_flags,
    "registry": _registry_flags,
    "lora": _lora_flags,
}


def _sentinels(text: str) -> tuple[tuple[str, int], ...]:
    from executor_svc.api.redis_conn import parse_sentinels

    try:
        return parse_sentinels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
