"""Host-memory prefix tier: multi-turn chat whose working set is ~3x the device cache, tier off
vs on, one executor, alternating runs.

    .venv/bin/python benchmarks/bench_host_tier.py [--model smollm2|demo|DIR] [--repeats 2]

The workload (tests/support/chat_workload.py): `--conversations` conversations sharing a
`--system`-token system prompt, each opening with `--first-user` tokens of its own; every later
turn's prompt is the conversation so far (earlier prompts and the model's answers) plus
`--user` new tokens; `--max-tokens` answer tokens (greedy for even conversations, seeded
sampling for odd ones). Turns go round-robin over the conversations, one request at a time
(`--concurrent`: a round's turns at once), so each turn's TTFT is its own prefill. The executor
gets `--device-blocks` KV blocks; by the time a conversation speaks again, the others have
pushed its blocks out of the device cache.

One Redis and one executor serve every run; each run starts a fresh scheduler (empty prefix
cache, zero counters): `off` without the tier, `on` with `--host-cache-blocks`. Per run it
prints the prefix-hit rate (prompt tokens found / looked up, from GetServerInfo), the tokens
found in the host tier, the prompt tokens recomputed, and the mean TTFT over all turns and over
turns after the first; at the end the ratios (off / on) and whether every run's tokens were the
same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scheduler_svc.local.redis_server import RedisServer  # noqa: E402
from tests.support.api_helpers import stub_for, wait_until_idle  # noqa: E402
from tests.support.chat_workload import ChatWorkload, run_chat  # noqa: E402
from tests.support.stack import Stack, demo_model_dir, stop_process  # noqa: E402


def model_dir(name: str, root: Path) -> Path:
    if name == "smollm2":
        from tests.support.smollm2 import ensure_smollm2

        return ensure_smollm2()
    if name in ("demo", "tiny"):
        return demo_model_dir(root, size=name)
    return Path(name)


def run_once(stack: Stack, w: ChatWorkload, sched_args: list[str], tag: str) -> dict:
    if stack.scheduler_proc is not None:
        stop_process(stack.scheduler_proc)
    stack.scheduler_args = sched_args
    stack.start_scheduler()
    channel, stub = stub_for(stack.address)
    try:
        res = run_chat(stub, w, tag)
        info = wait_until_idle(stub, timeout=60)
    finally:
        channel.close()
    if res.errors:
        raise RuntimeError(f"{tag}: {res.errors[:3]}\n{stack.logs()}")
    ex = info.executors[0]
    return {
        "tag": tag,
        "dtype": ex.dtype,
        "hit_rate": ex.prefix_cache_hits / ex.prefix_cache_queries,
        "queries": ex.prefix_cache_queries,
        "hits": ex.prefix_cache_hits,
        "host_hits": ex.prefix_cache_host_hits,
        "recomputed": ex.prefix_cache_queries - ex.prefix_cache_hits,
        "ttft_mean_ms": 1000 * statistics.mean(res.ttft_s),
        "ttft_later_mean_ms": 1000 * statistics.mean(res.later_ttft_s),
        "outputs": res.outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, demo, tiny or a directory")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device-blocks", type=int, default=60)
    ap.add_argument("--host-cache-blocks", type=int, default=256)
    ap.add_argument("--swap-space", type=float, default=0.5, help="executor CPU pool, GiB")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=128)
    ap.add_argument("--first-user", type=int, default=128)
    ap.add_argument("--user", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrent", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs, alternating")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    w = ChatWorkload(
        num_conversations=args.conversations,
        num_turns=args.turns,
        system_tokens=args.system,
        first_user_tokens=args.first_user,
        user_tokens=args.user,
        max_tokens=args.max_tokens,
        concurrent=args.concurrent,
    )
    block_size = 16
    ratio = w.working_set_tokens() / (args.device_blocks * block_size)
    print(
        f"working set {w.working_set_tokens()} tokens = {ratio:.2f}x the device cache "
        f"({args.device_blocks} blocks of {block_size})",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-host-tier-") as tmp_s:
        tmp = Path(tmp_s)
        redis = RedisServer(data_dir=tmp / "redis")
        redis.start()
        executor_args = [
            "--dtype", args.dtype, "--num-device-blocks", str(args.device_blocks),
            "--block-size", str(block_size), "--swap-space", str(args.swap_space),
        ]  # fmt: skip
        stack = Stack(tmp, model_dir(args.model, tmp / "models"), redis, executor_args)
        runs = []
        try:
            stack.start_executor()
            for r in range(args.repeats):
                for mode in ("off", "on"):
                    extra = ["--host-cache-blocks", str(args.host_cache_blocks)]
                    run = run_once(stack, w, extra if mode == "on" else [], f"{mode}{r}")
                    run["mode"] = mode
                    runs.append(run)
                    print(
                        f"{run['tag']:>5} ({run['dtype']}): hit rate {run['hit_rate']:.1%} (host {run['host_hits']}"
                        f" tokens), recomputed {run['recomputed']} of {run['queries']} prompt "
                        f"tokens, TTFT mean {run['ttft_mean_ms']:.1f} ms, later turns "
                        f"{run['ttft_later_mean_ms']:.1f} ms",
                        flush=True,
                    )
        finally:
            stack.stop()
            redis.stop()
    identical = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    summary = {}
    for mode in ("off", "on"):
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            k: statistics.mean(r[k] for r in mine)
            for k in ("hit_rate", "host_hits", "recomputed", "ttft_mean_ms", "ttft_later_mean_ms")
        }
    off, on = summary["off"], summary["on"]
    print(
        f"mean of {args.repeats}: hit rate {off['hit_rate']:.1%} -> {on['hit_rate']:.1%}; "
        f"TTFT {off['ttft_mean_ms']:.1f} -> {on['ttft_mean_ms']:.1f} ms "
        f"({off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x lower), later turns "
        f"{off['ttft_later_mean_ms']:.1f} -> {on['ttft_later_mean_ms']:.1f} ms "
        f"({off['ttft_later_mean_ms'] / on['ttft_later_mean_ms']:.2f}x); outputs identical "
        f"across all {len(runs)} runs: {identical}"
    )
    if args.json:
        for r in runs:
            del r["outputs"]
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": runs, "summary": summary,
                                         "identical": identical}, indent=1))  # fmt: skip
    if not identical:
        sys.exit(1)


if __name__ == "__main__":
    main()
