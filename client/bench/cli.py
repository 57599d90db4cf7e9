"""`llmserve bench throughput|serve` (also `python -m client.bench throughput|serve`)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from client.bench.backends import BACKENDS, Backend, make_backend
from client.bench.metrics import parse_slo
from client.bench.report import build_report, plot_sweep, to_markdown, write_report
from client.bench.serve import parse_rate, run_serve, run_sweep
from client.bench.throughput import run_throughput
from client.bench.workloads import WORKLOADS, make_workload
from client.errors import run_guarded


def _backends(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    for name in names:
        if name not in BACKENDS:
            raise argparse.ArgumentTypeError(f"unknown backend {name!r} (choose from {BACKENDS})")
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError("give each backend once, e.g. llmserve,hf")
    return names


def _rates(value: str) -> list[float]:
    try:
        return [parse_rate(v) for v in value.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        type=_backends,
        default=["llmserve"],
        help="llmserve, hf, openai, vllm, or several as llmserve,vllm (same requests, one report)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="scheduler host:port (default $LLMSERVE_ADDRESS or 127.0.0.1:50051)",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="openai backend: the server's URL, e.g. http://127.0.0.1:8000/v1",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="checkpoint directory (needed by hf, and by openai alone for the vocabulary size)",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="sharegpt-like")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    p.add_argument(
        "--output-len", type=int, default=128, help="random and shared-prefix: output tokens"
    )
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: length spread")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: common tokens")
    p.add_argument("--question-len", type=int, default=32, help="shared-prefix: own tokens")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="cap on prompt + output (default: the model's)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=256,
        help="hf static batch size and vllm max_num_seqs; use the scheduler's max running seqs",
    )
    p.add_argument("--hf-device", default="auto")
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    vllm = p.add_argument_group("vllm backend (vLLM's offline LLM in its own virtualenv)")
    vllm.add_argument("--vllm-python", default=None, help="that virtualenv's python")
    vllm.add_argument(
        "--vllm-cpu-cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0 or 0-1"
    )
    vllm.add_argument(
        "--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)"
    )
    vllm.add_argument("--vllm-dtype", default="float32")
    vllm.add_argument("--vllm-enforce-eager", action="store_true")
    vllm.add_argument("--vllm-no-prefix-caching", action="store_true")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--output", default=None, help="results JSON path; the markdown table goes next to it (.md)"
    )


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="throughput and serving benchmarks (issue 5)")
    modes = bench.add_subparsers(dest="bench_mode", required=True)
    _common(modes.add_parser("throughput", help="all requests at once; tokens per second"))
    serve = modes.add_parser("serve", help="Poisson arrivals; TTFT, TPOT, ITL, goodput")
    _common(serve)
    serve.add_argument(
        "--request-rate",
        type=parse_rate,
        default=math.inf,
        help="requests per second, or inf (default) to send all at once",
    )
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps; 1 = Poisson, < 1 burstier",
    )
    serve.add_argument(
        "--slo",
        nargs="*",
        default=[],
        metavar="KEY=MS",
        help="goodput SLOs, e.g. ttft=500 tpot=50 e2el=10000",
    )
    serve.add_argument(
        "--sweep",
        type=_rates,
        default=None,
        metavar="R1,R2,...",
        help="run once per rate and plot latency against rate",
    )
    serve.add_argument(
        "--plot", default=None, help="sweep PNG path (default: --output with .png, or sweep.png)"
    )


def _limits(args: argparse.Namespace, backends: dict[str, Backend]) -> tuple[int, int]:
    limits = [b.limits() for b in backends.values()]
    vocab_size = min(v for v, _ in limits)
    if vocab_size == sys.maxsize:
        raise ValueError(
            "the openai backend cannot tell the vocabulary size: give --model-dir, or run it "
            "beside the llmserve backend (--backend llmserve,openai)"
        )
    max_model_len = min(m for _, m in limits)
    if args.max_model_len is not None:
        max_model_len = min(max_model_len, args.max_model_len)
    return vocab_size, max_model_len


def _vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "python": args.vllm_python,
        "cpu_cores": args.vllm_cpu_cores,
        "kv_cache_gib": args.vllm_kv_cache_gib,
        "dtype": args.vllm_dtype,
        "enforce_eager": args.vllm_enforce_eager,
        "enable_prefix_caching": not args.vllm_no_prefix_caching,
        "max_model_len": args.max_model_len,
    }


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe; prints the markdown table, writes files if asked."""
    slo = parse_slo(args.slo) if getattr(args, "slo", None) else None
    progress = not args.no_progress
    backends: dict[str, Backend] = {}
    try:
        for name in args.backend:
            backends[name] = make_backend(
                name,
                address=args.address,
                model_dir=args.model_dir,
                max_batch_size=args.max_batch_size,
                hf_device=args.hf_device,
                hf_dtype=args.hf_dtype,
                base_url=args.base_url,
                vllm=_vllm_options(args),
            )
        vocab_size, max_model_len = _limits(args, backends)
        requests = make_workload(
            args.workload,
            args.num_prompts,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            seed=args.seed,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            prefix_len=args.prefix_len,
            question_len=args.question_len,
        )
        results: list[dict[str, Any]] = []
        for backend in backends.values():
            if not args.no_warmup:
                backend.warmup()
            if args.bench_mode == "throughput":
                results.append(run_throughput(backend, requests, progress=progress))
                continue
            kwargs = dict(
                max_concurrency=args.max_concurrency,
                burstiness=args.burstiness,
                seed=args.seed,
                slo=slo,
                progress=progress,
            )
            if args.sweep:
                results += run_sweep(backend, requests, args.sweep, **kwargs)
            else:
                results.append(
                    run_serve(backend, requests, request_rate=args.request_rate, **kwargs)
                )
    finally:
        for backend in backends.values():
            backend.close()

    config = {
        "mode": args.bench_mode,
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "seed": args.seed,
        "vocab_size": vocab_size,
        "max_model_len": max_model_len,
        "mean_input_len": sum(r.prompt_len for r in requests) / max(len(requests), 1),
        "mean_output_len": sum(r.output_len for r in requests) / max(len(requests), 1),
        "backends": ",".join(args.backend),
        "max_batch_size": args.max_batch_size if {"hf", "vllm"} & backends.keys() else None,
        "address": args.address if "llmserve" in backends else None,
        "base_url": args.base_url if "openai" in backends else None,
    }
    report = build_report(config, results)
    print(to_markdown(report))
    if args.output:
        json_path, md_path = write_report(report, args.output)
        print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    if getattr(args, "sweep", None):
        plot_path = args.plot or (
            str(args.output).rsplit(".", 1)[0] + ".png" if args.output else "sweep.png"
        )
        print(f"wrote {plot_sweep(results, plot_path)}", file=sys.stderr)
    return 1 if any(r.get("failed") for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    # Accept both `python -m client.bench throughput ...` and `... bench throughput ...`.
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        argv = ["bench", *argv]
    return run_guarded(run_bench, parser.parse_args(argv))
