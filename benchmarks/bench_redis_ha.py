"""What acknowledged writes cost, and how long a Redis failover stalls the streams.

Default mode: throughput and mean inter-token latency at 64 streams with a single Redis
(`appendfsync always`, as `make run`; and `everysec`, as the HA nodes) against Redis with 2
replicas + 3 Sentinels at --redis-min-replicas 0, 1, 2. Real processes on loopback (executor on
the tiny demo model, scheduler, Redis), the same workload for each configuration, `--rounds`
rounds of all configurations interleaved so that a noisy machine affects each alike. Prints one
Markdown table row per configuration (median of the rounds).

`--failovers N`: one scheduler on the Sentinels (--redis-min-replicas 1), N times: 16 streams
start, the primary is killed -9, and the time from its death to the first token any stream
gets after it is taken; the killed node then comes back as a replica. Prints every sample and
p50 / p90 / p99 (nearest rank).

    python benchmarks/bench_redis_ha.py [--streams 64] [--tokens 128] [--rounds 2]
    python benchmarks/bench_redis_ha.py --failovers 12 [--down-after-ms 1500]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import threading
import time
from pathlib import Path

from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import mixed_workload, stream_in_threads, stub_for
from tests.support.redis_ha import RedisHA
from tests.support.stack import make_stack

CONFIGS = ["single", "single-everysec", "ha-0", "ha-1", "ha-2"]


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
    if config.startswith("single"):
        fsync = "everysec" if config == "single-everysec" else "always"
        redis = RedisServer(work / "redis", appendfsync=fsync)
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


def wait_first_token_after(results: list, t0: float) -> float:
    """Seconds from `t0` (a kill) to the first token any stream gets after it. Tokens released
    before the kill reach the clients within 0.2 s (the failover takes longer than that: the
    Sentinels wait down-after-milliseconds), so counting starts there."""
    time.sleep(0.2)
    held = [len(r.tokens.get(0, [])) for r in results]
    while [len(r.tokens.get(0, [])) for r in results] == held:
        if time.monotonic() - t0 > 60:
            raise TimeoutError("no token within 60 s of the kill")
        time.sleep(0.002)
    return time.monotonic() - t0


def measure_failovers(root: Path, num: int, down_after_ms: int) -> list[float]:
    ha = RedisHA(root / "failover-ha", down_after_ms=down_after_ms).start()
    (root / "failover").mkdir()
    args = ["--redis-sentinel", ha.sentinel_arg, "--redis-min-replicas", "1",
            "--max-backlog-steps", "8"]  # fmt: skip
    stack = make_stack(root / "failover", ha.primary(), scheduler_args=args)
    outages: list[float] = []
    try:
        channel, stub = stub_for(stack.address)
        for k in range(num):
            reqs = mixed_workload(f"fo{k}", 16, 400, rng_seed=k, max_prompt_len=16)
            results, threads = stream_in_threads(stub, reqs, min_tokens=5)
            killed = ha.kill_primary()
            outages.append(wait_first_token_after(results, time.monotonic()))
            for t in threads:
                t.join(timeout=300)
            broken = [r.error for r in results if r.error is not None or 0 not in r.finish]
            assert not broken, broken[:3]
            ha.wait_failover(killed)
            ha.restart_as_replica(killed)
            ha.wait_healthy()
            print(f"failover {k}: {outages[-1]:.2f} s", flush=True)
        channel.close()
    finally:
        stack.stop()
        ha.close()
    return outages


def nearest_rank(samples: list[float], pct: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--failovers", type=int, default=0, help="measure N failovers instead")
    p.add_argument("--down-after-ms", type=int, default=1500, help="Sentinel's, for --failovers")
    args = p.parse_args()
    if args.failovers:
        with tempfile.TemporaryDirectory(prefix="bench-redis-failover-") as tmp:
            outages = measure_failovers(Path(tmp), args.failovers, args.down_after_ms)
        print("samples (s):", " ".join(f"{o:.2f}" for o in outages))
        print(" | ".join(f"p{q} {nearest_rank(outages, q):.2f} s" for q in (50, 90, 99)))
        return
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
