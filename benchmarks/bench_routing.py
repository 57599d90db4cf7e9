"""KV-aware routing vs least-loaded on a shared-prefix workload, two executors, same run.

    .venv/bin/python benchmarks/bench_routing.py [--model DIR] [--prefixes 8] [--per-prefix 25]

The workload: `--prefixes` distinct prompt prefixes ("system prompts") of `--prefix-len` tokens,
each followed by `--own-len` tokens of its own, `--output-len` tokens out (greedy, ignore_eos),
in a seeded random order, `--concurrency` in flight. Each executor's KV cache holds only part of
the prefixes (`--blocks` blocks each), so where a request goes decides what is recomputed.

Three configurations, real processes (Redis, executors, scheduler) for each:
  kv            two executors, --routing kv
  least-loaded  two executors, --routing least-loaded
  single        one executor with both caches (2 x --blocks): the hit rate to aim at

Prints, per configuration: output tokens/s, the prefix-cache hit rate (tokens found over tokens
looked up, from GetServerInfo), and the ratios the issue sets targets for:
hit(kv) / hit(single) and throughput(kv) / throughput(least-loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client import AsyncLLMClient, SamplingParams  # noqa: E402
from scheduler_svc.local.redis_server import RedisServer  # noqa: E402


def start(cmd: list[str], workdir: Path, name: str) -> tuple[subprocess.Popen, int]:
    port_file = workdir / f"{name}.port"
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 -- owned by the process
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*cmd, "--port-file", str(port_file)], stdout=log, stderr=log, env=env)
    deadline = time.monotonic() + 300
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {(workdir / f'{name}.log').read_text()}")
        time.sleep(0.1)
    return proc, int(port_file.read_text())


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    vocab = args.vocab
    prefixes = [
        [rng.randrange(3, vocab) for _ in range(args.prefix_len)] for _ in range(args.prefixes)
    ]
    prompts = [
        [*p, *(rng.randrange(3, vocab) for _ in range(args.own_len))]
        for p in prefixes
        for _ in range(args.per_prefix)
    ]
    rng.shuffle(prompts)
    return prompts


async def drive(address: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(args.concurrency)
    async with AsyncLLMClient(address, timeout=60) as client:
        await client.wait_ready(120)

        async def one(prompt: list[int]) -> int:
            async with gate:
                out = await client.generate([prompt], params, use_tqdm=False)
                return len(out[0].outputs[0].token_ids)

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        elapsed = time.perf_counter() - start
        info = await client.server_info()
    queries = sum(e.prefix_cache_queries for e in info.executors)
    hits = sum(e.prefix_cache_hits for e in info.executors)
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 2),
        "tok_s": round(tokens / elapsed, 1),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "per_executor_hit_rate": [
            round(e.prefix_cache_hits / e.prefix_cache_queries, 3) if e.prefix_cache_queries else 0
            for e in info.executors
        ],
    }


def run_config(name: str, executors: int, blocks: int, routing: str, args, prompts) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-routing-{name}-"))
    redis = RedisServer(data_dir=work / "redis")
    redis.start()
    procs: list[subprocess.Popen] = []
    try:
        addresses = []
        for i in range(executors):
            proc, port = start(
                [sys.executable, "-m", "executor_svc", "--model", args.model, "--port", "0",
                 "--num-device-blocks", str(blocks), "--swap-space", "0.2",
                 "--cpu-threads", str(args.cpu_threads)],
                work, f"executor{i}",
            )  # fmt: skip
            procs.append(proc)
            addresses.append(f"127.0.0.1:{port}")
        executor_flags = [flag for a in addresses for flag in ("--executor", a)]
        proc, port = start(
            [sys.executable, "-m", "scheduler_svc", *executor_flags, "--redis-url", redis.url,
             "--port", "0", "--routing", routing, "--log-level", "warning",
             *args.scheduler_args.split()],
            work, "scheduler",
        )  # fmt: skip
        procs.append(proc)
        result = asyncio.run(drive(f"127.0.0.1:{port}", prompts, args))
        return {"config": name, "executors": executors, "blocks_each": blocks, **result}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="checkpoint directory, or demo")
    p.add_argument("--vocab", type=int, default=4096, help="token ids are drawn below this")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--per-prefix", type=int, default=25)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--own-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--blocks", type=int, default=384, help="KV blocks per executor (16 tokens)")
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduler-args", default="", help="extra scheduler flags, e.g. weights")
    p.add_argument("--configs", default="kv,least-loaded,single")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    prompts = workload(args)
    plans = {
        "kv": (2, args.blocks, "kv"),
        "least-loaded": (2, args.blocks, "least-loaded"),
        "single": (1, 2 * args.blocks, "kv"),
    }
    results = {}
    for name in args.configs.split(","):
        executors, blocks, routing = plans[name]
        results[name] = run_config(name, executors, blocks, routing, args, prompts)
        print(json.dumps(results[name]), flush=True)
    summary = {}
    if {"kv", "single"} <= results.keys() and results["single"]["hit_rate"]:
        summary["hit_kv_over_single"] = round(
            results["kv"]["hit_rate"] / results["single"]["hit_rate"], 3
        )
    if {"kv", "least-loaded"} <= results.keys():
        summary["tok_s_kv_over_least_loaded"] = round(
            results["kv"]["tok_s"] / results["least-loaded"]["tok_s"], 3
        )
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "results": results,
                    "summary": summary,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
