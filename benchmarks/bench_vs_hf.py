"""llmserve (whole stack over gRPC) against Hugging Face transformers, in one run.

Builds the SmolLM-135M-shaped random Llama (fp32), starts Redis, an executor and the scheduler as
processes on loopback, then runs `client.bench throughput` with `--backend llmserve,hf` on the
three workloads (same requests for both; ratio llmserve / hf in the report), plus prefix caching
on vs off on the shared-prefix workload (llmserve only, scheduler restarted in between).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_vs_hf.py --out bench-results/cpu

Results: one JSON + markdown file per run under --out, and a summary table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scheduler_svc.local.redis_server import RedisServer  # noqa: E402

THREADS = 1
EXECUTOR_EXTRA: list[str] = []  # more executor flags (bench_vs_vllm.py sets --cpu-threads)

SMOLLM_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The same number of torch threads for the executor and for HF (set by --threads).
    e["OMP_NUM_THREADS"] = str(THREADS)
    return e


def build_model(cache: Path) -> Path:
    from executor_svc.demo.demo_model import build_demo_model

    out = cache / "smollm-135m-random"
    if not (out / "model.safetensors").exists():
        build_demo_model(out, seed=0, size="demo", **SMOLLM_135M)
    return out


def wait_port(path: Path, proc: subprocess.Popen, what: str, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        time.sleep(0.1)
    raise SystemExit(f"{what} did not start")


class Stack:
    def __init__(self, model: Path, work: Path, max_num_seqs: int, blocks: int) -> None:
        self.model, self.work = model, work
        self.max_num_seqs, self.blocks = max_num_seqs, blocks
        self.redis = RedisServer(data_dir=work / "redis")
        self.executor = self.scheduler = None

    def start_executor(self) -> None:
        pf = self.work / "executor.port"
        self.executor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "executor_svc",
                "--model",
                str(self.model),
                "--port",
                "0",
                "--port-file",
                str(pf),
                "--num-device-blocks",
                str(self.blocks),
                "--log-level",
                "warning",
                *EXECUTOR_EXTRA,
            ],  # fmt: skip
            env=env(),
        )
        self.executor_port = wait_port(pf, self.executor, "executor")

    def start_scheduler(self, *extra: str) -> str:
        pf = self.work / f"scheduler-{time.monotonic_ns()}.port"
        self.scheduler = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scheduler_svc",
                "--executor",
                f"127.0.0.1:{self.executor_port}",
                "--redis-url",
                self.redis.url,
                "--port",
                "0",
                "--port-file",
                str(pf),
                "--max-num-seqs",
                str(self.max_num_seqs),
                "--log-level",
                "warning",
                *extra,
            ],  # fmt: skip
            env=env(),
        )
        port = wait_port(pf, self.scheduler, "scheduler")
        time.sleep(1.0)  # connect + tokenizer fetch
        return f"127.0.0.1:{port}"

    def stop_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.terminate()
            self.scheduler.wait(timeout=60)
            self.scheduler = None

    def close(self) -> None:
        self.stop_scheduler()
        if self.executor is not None:
            self.executor.terminate()
            self.executor.wait(timeout=60)
        self.redis.close()


def run_bench(args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "client.bench", "throughput", *args, "--output", str(out)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env(), check=True)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-results/cpu"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-device-blocks", type=int, default=4096)
    p.add_argument("--sharegpt-prompts", type=int, default=64)
    p.add_argument("--random-prompts", type=int, default=64)
    p.add_argument("--random-input", type=int, default=128)
    p.add_argument("--random-output", type=int, default=128)
    p.add_argument("--prefix-prompts", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--prefix-output", type=int, default=32)
    p.add_argument("--only", nargs="*", help="subset of: sharegpt random prefix prefix-off")
    p.add_argument("--threads", type=int, default=1, help="torch threads, executor and HF alike")
    args = p.parse_args()
    global THREADS
    THREADS = args.threads
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_model(ROOT / ".cache")
    work = Path(tempfile.mkdtemp(prefix="bench-vs-hf-"))
    stack = Stack(model, work, args.max_num_seqs, args.num_device_blocks)
    stack.redis.start()
    stack.start_executor()
    common = ["--model-dir", str(model), "--max-batch-size", str(args.max_num_seqs), "--seed", "0"]
    wanted = set(args.only or ["sharegpt", "random", "prefix", "prefix-off"])
    results = {}
    try:
        address = stack.start_scheduler()
        both = ["--backend", "llmserve,hf", "--address", address, *common]
        if "sharegpt" in wanted:
            results["sharegpt-like"] = run_bench(
                [*both, "--workload", "sharegpt-like", "--num-prompts", str(args.sharegpt_prompts)],
                args.out / "sharegpt.json",
            )
        if "random" in wanted:
            results["random"] = run_bench(
                [
                    *both,
                    "--workload",
                    "random",
                    "--num-prompts",
                    str(args.random_prompts),
                    "--input-len",
                    str(args.random_input),
                    "--output-len",
                    str(args.random_output),
                    "--range-ratio",
                    "0",
                ],  # fmt: skip
                args.out / "random.json",
            )
        prefix = [
            "--workload", "shared-prefix", "--num-prompts", str(args.prefix_prompts),
            "--prefix-len", str(args.prefix_len), "--question-len", str(args.question_len),
            "--output-len", str(args.prefix_output),
        ]  # fmt: skip
        if "prefix" in wanted:
            results["shared-prefix"] = run_bench([*both, *prefix], args.out / "prefix.json")
        if "prefix-off" in wanted:
            stack.stop_scheduler()
            address = stack.start_scheduler("--no-prefix-caching")
            results["shared-prefix (no prefix caching)"] = run_bench(
                ["--backend", "llmserve", "--address", address, *common, *prefix],
                args.out / "prefix-off.json",
            )
    finally:
        stack.close()
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    print(f"\nresults in {args.out}")


if __name__ == "__main__":
    main()
