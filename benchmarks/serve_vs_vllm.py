"""llmserve and `vllm serve` on the same checkpoint, both driven by vLLM's own `vllm bench serve`.

Starts one server at a time (the llmserve stack with its OpenAI frontend, then vLLM's CPU
server; ``--rounds 2`` alternates them twice), each on ``--threads`` compute threads, and runs
`vllm bench serve` (``benchmarks/vllm_bench_serve.py`` in the vLLM venv) against it for every
dataset and concurrency asked: ``random`` (fixed lengths), ``prefix`` (vLLM's
prefix_repetition: prompts sharing long prefixes) and ``sharegpt-like`` (our harness's
heavy-tailed lengths written as a vLLM ``custom`` dataset, since ShareGPT itself would be a
download). Prints one table with the ratio llmserve / vLLM per cell, and the CPU's flags.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serve_vs_vllm.py --model-dir DIR \\
        --vllm-python /path/to/vllm-venv/bin/python --dtype float32 --concurrency 1,16,64

The vLLM venv comes from ``make vllm-venv`` (never a dependency of llmserve).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> str:
    words = (
        set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    )
    return " ".join(f for f in FLAGS if f in words) or "unknown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s (log {log})")


def start_llmserve(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log = work / "llmserve.log"
    cmd = [
        sys.executable, "-m", "scheduler_svc.local.launch", "--model", str(args.model_dir),
        "--scheduler-port", str(free_port()), "--executor-port", str(free_port()),
        "--frontend-port", str(port), "--redis-dir", str(work / "redis"),
        f"--executor-arg=--dtype={args.dtype}", f"--executor-arg=--cpu-threads={args.threads}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_health(f"http://127.0.0.1:{port}/health", proc, 600, log)
    return proc, port, log


def start_vllm(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log = work / "vllm.log"
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}"
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    cmd = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(args.model_dir), "--port", str(port), "--dtype", args.dtype,
        "--max-num-seqs", str(max(args.concurrency)), "--served-model-name", args.model_name,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_health(f"http://127.0.0.1:{port}/health", proc, 900, log)
    return proc, port, log


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sharegpt_like_dataset(args: argparse.Namespace, path: Path, num: int) -> None:
    """Our heavy-tailed lengths as vLLM's ``custom`` JSONL: one prompt of about the drawn
    length (words of the model's vocabulary) and its output length per line."""
    sys.path.insert(0, str(ROOT))
    from client.bench.workloads import sharegpt_like_lengths

    ins, outs = sharegpt_like_lengths(num, max_model_len=args.max_model_len, seed=0)
    words = ["the", "model", "serves", "tokens", "fast", "and", "well", "today"]
    with path.open("w") as f:
        for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
            prompt = " ".join(words[(i + j) % len(words)] for j in range(int(n_in)))
            f.write(json.dumps({"prompt": prompt, "output_tokens": int(n_out)}) + "\n")


def dataset_args(name: str, args: argparse.Namespace, work: Path, num: int) -> list[str]:
    if name == "random":
        return ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len)]  # fmt: skip
    if name == "prefix":
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len",
                str(args.prefix_len), "--prefix-repetition-suffix-len", "32",
                "--prefix-repetition-num-prefixes", "4",
                "--prefix-repetition-output-len", str(args.output_len)]  # fmt: skip
    if name == "sharegpt-like":
        path = work / f"sharegpt-like-{num}.jsonl"
        if not path.exists():
            sharegpt_like_dataset(args, path, num)
        return ["--dataset-name", "custom", "--dataset-path", str(path), "--skip-chat-template"]
    raise ValueError(f"unknown dataset {name!r}")


def bench(args: argparse.Namespace, port: int, name: str, conc: int, work: Path, tag: str) -> dict:
    num = max(args.min_prompts, args.prompts_per_stream * conc)
    result = work / f"{tag}-{name}-c{conc}.json"
    cmd = [
        args.vllm_python, str(ROOT / "benchmarks" / "vllm_bench_serve.py"),
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions", "--model", args.model_name,
        "--tokenizer", str(args.model_dir), "--num-prompts", str(num),
        "--max-concurrency", str(conc), "--ignore-eos", "--seed", "0",
        "--save-result", "--result-dir", str(work), "--result-filename", result.name,
        *dataset_args(name, args, work, num),
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({tag} {name} c{conc}):\n{out.stderr[-3000:]}")
    return json.loads(result.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--datasets", default="random,sharegpt-like,prefix")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--prompts-per-stream", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="compute threads per server")
    p.add_argument("--rounds", type=int, default=1, help="alternate the two servers")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=None, help="keep results here")
    args = p.parse_args()
    args.model_dir = args.model_dir.resolve()
    args.model_name = args.model_dir.name
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    datasets = args.datasets.split(",")
    work = args.out or Path(tempfile.mkdtemp(prefix="serve-vs-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"CPU flags: {cpu_flags()}; {os.cpu_count()} CPUs; dtype {args.dtype}; "
          f"{args.threads} compute thread(s) per server; results in {work}")  # fmt: skip
    results: dict[tuple[str, str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for tag, start in (("llmserve", start_llmserve), ("vllm", start_vllm)):
            proc, port, _ = start(args, work)
            try:
                for name in datasets:
                    for conc in args.concurrency:
                        r = bench(args, port, name, conc, work, tag)
                        results.setdefault((tag, name, conc), []).append(r)
                        print(f"{tag:8} {name:13} c={conc:<3} {r['output_throughput']:9.1f} "
                              f"out tok/s  TTFT {r['mean_ttft_ms']:8.1f} ms  "
                              f"TPOT {r['mean_tpot_ms']:7.1f} ms", flush=True)  # fmt: skip
            finally:
                stop(proc)
    print("\n| dataset | concurrency | llmserve out tok/s | vLLM out tok/s | ratio | "
          "llmserve TTFT ms | vLLM TTFT ms |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in datasets:
        for conc in args.concurrency:
            ours, theirs = results[("llmserve", name, conc)], results[("vllm", name, conc)]

            def mean(rs: list[dict], key: str) -> float:
                return sum(r[key] for r in rs) / len(rs)

            o, v = mean(ours, "output_throughput"), mean(theirs, "output_throughput")
            print(f"| {name} | {conc} | {o:.1f} | {v:.1f} | {o / v:.2f} | "
                  f"{mean(ours, 'mean_ttft_ms'):.0f} | {mean(theirs, 'mean_ttft_ms'):.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
