"""What acknowledged writes cost: throughput and mean inter-token latency at 64 streams with a
single Redis against Redis with 2 replicas + 3 Sentinels at --redis-min-replicas 0, 1, 2.

Real processes on loopback (executor on the tiny demo model, scheduler, Redis), the same
workload for each configuration, `--rounds` rounds of all configurations interleaved so that a
noisy machine affects each alike. Prints one Markdown table row per configuration (median of the
rounds).

    python benchmarks/bench_redis_ha.py [--streams 64] [--tokens 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from scheduler_svc.local.redis_ha import RedisHA
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import mixed_workload, stub_for
from tests.support.stack import make_stack

CONFIGS = ["single", "ha-0", "ha-1", "ha-2"]


def run_streams(address: str, num: int, tokens: int, tag: str) -> tuple[float, float]:
    """(output tokens per second, mean inter-token latency in ms) of `num` streams (half
    greedy, half seeded sampling; ignore_eos, so every stream yields `tokens` tokens)."""
    reqs = mixed_workload(tag, num, tokens, rng_seed=1, max_prompt_len=16)
    itls: list[float] = []
    lock = threading.Lock()
    channel, stub = stub_for(address)

    def one(req) -> None:
        times = [time.perf_counter() for msg in stub.Generate(req, timeout=300) if msg.token_ids]
        if len(times) > 1:
            with lock:
                itls.append((times[-1] - times[0]) / (len(times) - 1))

    threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    channel.close()
    return num * tokens / elapsed, 1000 * statistics.mean(itls)


def measure(
    config: str, root: Path, args: argparse.Namespace, round_no: int
) -> tuple[float, float]:
    work = root / f"{config}-{round_no}"
    work.mkdir(parents=True)
    ha = None
    if config == "single":
        redis = RedisServer(work / "redis")
        redis.start()
        extra: list[str] = []
    else:
        ha = RedisHA(work / "redis-ha").start()
        redis = ha.primary()
        extra = ["--redis-sentinel", ha.sentinel_arg, "--redis-min-replicas", config[3:]]
    stack = make_stack(work, redis, scheduler_args=extra)
    try:
        run_streams(stack.address, 8, 16, "warm")  # first steps build caches, connections
        return run_streams(stack.address, args.streams, args.tokens, f"b{round_no}")
    finally:
        stack.stop()
        if ha is not None:
            ha.close()
        else:
            redis.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    results: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="bench-redis-ha-") as tmp:
        for round_no in range(args.rounds):
            for config in CONFIGS:
                results[config].append(measure(config, Path(tmp), args, round_no))
                print(config, round_no, results[config][-1], flush=True)
    base = statistics.median(r[0] for r in results["single"])
    print("\n| Redis | throughput (tok/s) | vs single | mean ITL (ms) |")
    print("| --- | --- | --- | --- |")
    for config in CONFIGS:
        tput = statistics.median(r[0] for r in results[config])
        itl = statistics.median(r[1] for r in results[config])
        print(f"| {config} | {tput:.0f} | {tput / base:.2f} | {itl:.1f} |")


if __name__ == "__main__":
    main()
