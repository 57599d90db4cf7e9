"""llmserve (whole stack over gRPC) against vLLM's CPU engine, in one run, with the GEMM roofline.

Builds the SmolLM-135M-shaped random Llama (fp32), starts Redis, an executor (one torch thread)
and the scheduler, then runs `client.bench throughput --backend llmserve,vllm` on the chosen
workloads (same requests; vLLM's offline `LLM` in a subprocess of its own virtualenv, its
compute thread bound to one core). Before and after, it times one thread's matmuls on the
model's matrix shapes (``torch.mm``, and oneDNN on prepacked weights: the faster here, so the
roofline) and prints the GEMM floor of each workload: the matmul FLOPs the work needs (every computed token through every layer, plus the lm_head for sampled rows only;
attention not counted) at the measured rate, and each backend's share of that floor.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_vs_vllm.py \\
        --vllm-python /path/to/vllm-venv/bin/python --only random --out bench-results/vllm

Workloads: random (64 x 128 -> 128), sharegpt (200 sharegpt-like), prefix (64 x (1024 common
+ 32 own) -> 32), prefix-off (the same, llmserve's prefix caching off, llmserve only), b1
(batch-1 decode latency at 512 tokens of context, see ``batch1_latency``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_vs_hf  # noqa: E402
from bench_vs_hf import SMOLLM_135M, Stack, build_model, run_bench  # noqa: E402

from client.bench.workloads import make_workload  # noqa: E402


def gemm_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(in, out) of every matmul in one decoder layer (q|k|v and gate|up packed)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    return [(h, h + 2 * kv), (h, h), (h, 2 * inter), (inter, h)]


def gemm_rate(cfg: dict, m: int, kind: str = "packed", repeats: int = 5) -> float:
    """FLOP/s of one thread running the model's layer matmuls and the lm_head with m rows:
    ``mm`` = ``torch.mm`` (MKL), ``packed`` = oneDNN on prepacked weights (the fastest here)."""
    import torch

    from executor_svc.kernels.gemm import OneDnnWeight

    torch.set_num_threads(1)
    shapes = [*gemm_shapes(cfg), (cfg["hidden_size"], cfg["vocab_size"])]
    mats = [(torch.randn(m, k), torch.randn(k, n)) for k, n in shapes]
    if kind == "packed":
        mats = [(a, OneDnnWeight.pack(b)) for a, b in mats]
        if any(b is None for _, b in mats):
            return float("nan")
    flops = sum(2 * m * k * n for k, n in shapes)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for a, b in mats:
            torch.mm(a, b) if kind == "mm" else b.linear(a, None)
        best = min(best, time.perf_counter() - start)
    return flops / best


def measure_rates(cfg: dict) -> dict[str, dict[int, float]]:
    return {kind: {m: gemm_rate(cfg, m, kind) for m in (64, 2048)} for kind in ("mm", "packed")}


def _fmt_rates(rates: dict[str, dict[int, float]]) -> str:
    return ", ".join(
        f"{kind} M=64 {r[64] / 1e9:.1f} / M=2048 {r[2048] / 1e9:.1f} GFLOP/s"
        for kind, r in rates.items()
    )


def gemm_flops(cfg: dict, computed_tokens: int, sampled_rows: int) -> float:
    per_token = 2 * cfg["num_hidden_layers"] * sum(k * n for k, n in gemm_shapes(cfg))
    return computed_tokens * per_token + sampled_rows * 2 * cfg["hidden_size"] * cfg["vocab_size"]


def floor_seconds(cfg: dict, requests: list, rates: dict[int, float], cached: int) -> float:
    """The GEMM floor: prefill tokens at the large-M rate, decode rows at the M=64 rate.

    `cached` prompt tokens per request after the first are served from the prefix cache.
    """
    prefill = sum(r.prompt_len for r in requests) - cached * max(len(requests) - 1, 0)
    decode = sum(r.output_len - 1 for r in requests)
    samples = sum(r.output_len for r in requests)
    return (
        gemm_flops(cfg, prefill, len(requests)) / rates[2048]
        + gemm_flops(cfg, decode, samples - len(requests)) / rates[64]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--vllm-cpu-cores", default="1")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("bench-results/vllm"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-device-blocks", type=int, default=4096)
    p.add_argument("--only", nargs="*", help="subset of: random sharegpt prefix prefix-off b1")
    p.add_argument("--backends", default="llmserve,vllm")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both engines' dtype (llmserve --dtype, vLLM --dtype)",
    )
    p.add_argument("--executor-args", default="", help="extra executor flags, space separated")
    p.add_argument(
        "--pin",
        action="store_true",
        help="give each engine's compute thread the core(s) of --vllm-cpu-cores to itself: "
        "llmserve's executor runs there (--cpu-cores), vLLM's compute thread is bound there, "
        "and this script with everything it starts (llmserve's scheduler, Redis, the clients, "
        "vLLM's front-end process) runs on the other cores",
    )
    p.add_argument(
        "--scheduler-args",
        default="",
        help="extra scheduler flags, space separated (e.g. --no-async-scheduling)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat each workload, alternating which backend runs first (ABBA); median ratio",
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_model(ROOT / ".cache")
    all_rates = measure_rates(SMOLLM_135M)
    print(f"one-thread GEMM rates: {_fmt_rates(all_rates)}")
    # The roofline: the best rate one thread reaches on these shapes (oneDNN on prepacked
    # weights where torch has oneDNN); the torch.mm floor is printed beside it.
    packed_ok = all(r == r for r in all_rates["packed"].values())  # not NaN
    rates = all_rates["packed"] if packed_ok else all_rates["mm"]
    work = Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    stack = Stack(model, work, args.max_num_seqs, args.num_device_blocks)
    bench_vs_hf.EXECUTOR_EXTRA = [
        "--cpu-threads", "1", "--dtype", args.dtype, *args.executor_args.split()
    ]  # fmt: skip
    if args.pin:
        from executor_svc.config.cpus import format_cpu_list, parse_cpu_list

        compute = parse_cpu_list(args.vllm_cpu_cores)
        rest = os.sched_getaffinity(0) - compute
        if not rest:
            p.error("--pin needs a core besides --vllm-cpu-cores")
        os.sched_setaffinity(0, rest)  # inherited by every process started from here on
        bench_vs_hf.EXECUTOR_EXTRA += ["--cpu-cores", args.vllm_cpu_cores]
        print(f"pinned: compute on {args.vllm_cpu_cores}, the rest on {format_cpu_list(rest)}")
    stack.redis.start()
    stack.start_executor()
    common = [
        "--model-dir", str(model), "--max-batch-size", str(args.max_num_seqs),
        "--vllm-python", args.vllm_python, "--vllm-cpu-cores", args.vllm_cpu_cores,
        "--vllm-kv-cache-gib", str(args.vllm_kv_cache_gib), "--no-progress",
        "--vllm-dtype", args.dtype,
    ]  # fmt: skip
    workloads = {
        "random": (["--workload", "random", "--num-prompts", "64", "--input-len", "128",
                    "--output-len", "128"], 0),
        "sharegpt": (["--workload", "sharegpt-like", "--num-prompts", "200"], 0),
        "prefix": (["--workload", "shared-prefix", "--num-prompts", "64", "--prefix-len", "1024",
                    "--question-len", "32", "--output-len", "32"], 1024),
    }  # fmt: skip
    wanted = args.only or ["random", "sharegpt", "prefix", "prefix-off", "b1"]
    results = {}
    try:
        scheduler_args = args.scheduler_args.split()
        address = stack.start_scheduler(*scheduler_args)
        for name in [w for w in wanted if w in workloads]:
            flags, cached = workloads[name]
            order = args.backends.split(",")
            ratios = []
            for rnd in range(args.rounds):
                backends = ",".join(order if rnd % 2 == 0 else order[::-1])
                # A new seed each round: llmserve's stack (and its prefix cache) outlives a
                # round while vLLM starts afresh, so repeated prompts would be cache hits for
                # llmserve alone.
                report = run_bench(
                    ["--backend", backends, "--address", address, *common, *flags,
                     "--seed", str(rnd)],
                    args.out / f"{name}-{rnd}.json",
                )  # fmt: skip
                ratios += [r["output_throughput"] for r in report["ratios"]]
                _print_summary(f"{name}#{rnd}", report, None)
            if len(ratios) > 1:
                print(f"{name:>10} llmserve / baseline per round: "
                      f"{', '.join(f'{r:.3f}' for r in ratios)}; median "
                      f"{statistics.median(ratios):.3f}", flush=True)  # fmt: skip
            requests = make_workload(
                report["config"]["workload"],
                report["config"]["num_prompts"],
                vocab_size=report["config"]["vocab_size"],
                max_model_len=report["config"]["max_model_len"],
                seed=args.rounds - 1,  # the requests of the last round, whose report this is
                **_workload_kwargs(flags),
            )
            floor = floor_seconds(SMOLLM_135M, requests, rates, cached)
            mm_floor = floor_seconds(SMOLLM_135M, requests, all_rates["mm"], cached)
            results[name] = {"report": report, "gemm_floor_s": floor, "mm_floor_s": mm_floor}
            print(f"{name:>10} torch.mm floor {mm_floor:.1f} s")
            _print_summary(name, report, floor)
        if "b1" in wanted:
            order = args.backends.split(",")
            rounds = [
                batch1_latency(
                    address, common, ",".join(order if rnd % 2 == 0 else order[::-1]), args.out
                )
                for rnd in range(args.rounds)
            ]
            results["b1"] = rounds[-1] | {"rounds": rounds}
            if len(rounds) > 1:
                for b in order:
                    per = [r["ms_per_token"][b] for r in rounds]
                    print(f"{'b1':>10} {b:>8}: {', '.join(f'{v:.2f}' for v in per)} ms per "
                          f"token; median {statistics.median(per):.2f}", flush=True)  # fmt: skip
        if "prefix-off" in wanted:
            stack.stop_scheduler()
            address = stack.start_scheduler("--no-prefix-caching", *scheduler_args)
            flags, _ = workloads["prefix"]
            report = run_bench(
                ["--backend", "llmserve", "--address", address, *common, *flags],
                args.out / "prefix-off.json",
            )
            results["prefix-off"] = {"report": report}
            _print_summary("prefix-off", report, None)
    finally:
        stack.close()
    rates_after = measure_rates(SMOLLM_135M)
    print(f"GEMM rates after: {_fmt_rates(rates_after)}")
    (args.out / "summary.json").write_text(
        json.dumps({"rates": all_rates, "rates_after": rates_after, "results": results}, indent=2)
    )


def batch1_latency(address: str, common: list[str], backends: str, out: Path) -> dict:
    """Batch-1 decode: one 512-token prompt run to 1 and to 129 output tokens; the difference
    of the two wall times over 128 is the time per decoded token at ~512-640 tokens of context,
    whatever each engine's fixed cost per request. A first run to 1 token warms both engines'
    prefix caches, so both timed runs find the prompt cached (otherwise the first pays the
    prefill and the second does not)."""
    times: dict[str, dict[int, float]] = {}
    for n, name in ((1, "b1-warmup"), (1, "b1-1"), (129, "b1-129")):
        flags = ["--workload", "random", "--num-prompts", "1", "--input-len", "512",
                 "--output-len", str(n)]  # fmt: skip
        report = run_bench(
            ["--backend", backends, "--address", address, *common, *flags], out / f"{name}.json"
        )
        if name == "b1-warmup":
            continue
        for r in report["results"]:
            times.setdefault(r["backend"], {})[n] = r["duration_s"]
    ms = {b: (t[129] - t[1]) / 128 * 1e3 for b, t in times.items()}
    for b, v in ms.items():
        print(f"{'b1':>10} {b:>8}: {v:.2f} ms per token at 512 tokens of context", flush=True)
    return {"durations": times, "ms_per_token": ms}


def _workload_kwargs(flags: list[str]) -> dict:
    names = {"--input-len": "input_len", "--output-len": "output_len",
             "--prefix-len": "prefix_len", "--question-len": "question_len"}  # fmt: skip
    out = {"input_len": 256, "output_len": 128, "prefix_len": 512, "question_len": 32}
    for flag, value in zip(flags, flags[1:], strict=False):
        if flag in names:
            out[names[flag]] = int(value)
    return out


def _print_summary(name: str, report: dict, floor: float | None) -> None:
    for r in report["results"]:
        line = (
            f"{name:>10} {r['backend']:>8}: {r['output_throughput']:7.1f} out tok/s, "
            f"{r['duration_s']:6.1f} s, {r['completed']} ok / {r['failed']} failed"
        )
        if floor is not None:
            line += f", GEMM floor {floor:.1f} s = {floor / r['duration_s']:.0%} of roofline"
        print(line, flush=True)
    for ratio in report.get("ratios", []):
        print(f"{name:>10} llmserve / {ratio['baseline']}: {ratio['output_throughput']:.3f}")


if __name__ == "__main__":
    main()
