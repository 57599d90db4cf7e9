"""Prefill/decode disaggregation against colocated serving on the same cores (issue 47).

Real processes on loopback: Redis, two executors on a demo model, the scheduler. Per mode:

- `pd`: executor P `--role prefill --cpu-cores 0`, executor D `--role decode --cpu-cores 1`:
  every request is prefilled on P and decodes on D after its first token;
- `colocated`: two `--role both` executors, on core 0 and core 1; the router spreads the
  requests, and each executor runs prefill chunks and decodes in the same steps.

Each executor runs one torch thread on its core (`--cpu-cores` pins it); the scheduler, Redis
and this client float over the same cores (on a 2-core machine they share them with the
executors: part of the noise). The workload: `--streams` decode streams (short prompts,
`--tokens` tokens each) start; once each has `--warm-tokens` tokens, `--long` long prompts
(`--long-len` tokens, `--long-tokens` tokens out) arrive one every `--every` seconds. Reported
per run: the decode streams' inter-token latency (gaps between a stream's token deltas)
while the long prompts arrive and run (from the first long prompt's arrival until the last one
finished), p50 / p99 / max, the long prompts' mean TTFT, the handoffs counted, and whether every
decode stream's output equals a reference run (colocated, before the timed runs).

    python benchmarks/bench_pd.py [--size demo] [--streams 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import gen_request, mixed_workload, stub_for
from tests.support.prom import free_port, scrape, total
from tests.support.stack import demo_model_dir, start_two_executor_stack

EXECUTOR_ARGS = ["--num-device-blocks", "2048", "--swap-space", "0.01"]
ROLES = {"pd": ("prefill", "decode"), "colocated": ("both", "both")}


class Stream:
    """One streaming Generate in a thread: its tokens and when each delta came."""

    def __init__(self, stub, req) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.sent = time.perf_counter()
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(stub, req))
        self.thread.start()

    def _run(self, stub, req) -> None:
        try:
            for msg in stub.Generate(req, timeout=900):
                if msg.token_ids:
                    self.tokens.extend(msg.token_ids)
                    self.times.append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 -- reported
            self.error = e

    def gaps_within(self, t0: float, t1: float) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False) if t0 <= b <= t1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _handoff_seconds(log: str) -> list[tuple[float, float]]:
    """(lock wait, move) seconds of each handoff batch the scheduler logged."""
    out = []
    for line in log.splitlines():
        if "request.handed_off" in line:
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            out.append((float(fields["lock_wait_s"]), float(fields["move_s"])))
    return out


def one_run(args, mode: str, tmp: Path, model_dir: Path) -> dict:
    first, second = ROLES[mode]
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    port = free_port()
    a, b = start_two_executor_stack(
        tmp,
        redis,
        [*EXECUTOR_ARGS, "--role", first, "--cpu-cores", "0"],
        second_args=[*EXECUTOR_ARGS, "--role", second, "--cpu-cores", "1"],
        scheduler_args=["--metrics-port", str(port), "--log-level", "info",
                        "--max-num-batched-tokens", str(args.max_batched_tokens)],
        model_dir=model_dir,
    )  # fmt: skip
    try:
        channel, stub = stub_for(a.address)
        reqs = mixed_workload("dec", args.streams, args.tokens, rng_seed=3, max_prompt_len=32)
        streams = [Stream(stub, r) for r in reqs]
        while min(len(s.tokens) for s in streams) < args.warm_tokens:
            time.sleep(0.005)
        rng = random.Random(5)
        longs = []
        t0 = time.perf_counter()
        for i in range(args.long):
            prompt = [rng.randrange(5, 4000) for _ in range(args.long_len)]
            params = dict(max_tokens=args.long_tokens, ignore_eos=True, temperature=0.0)
            longs.append(Stream(stub, gen_request(prompt, request_id=f"long-{i}", **params)))
            time.sleep(args.every)
        for s in longs:
            s.thread.join(timeout=900)
        t1 = time.perf_counter()
        for s in streams:
            s.thread.join(timeout=900)
        gaps = [g for s in streams for g in s.gaps_within(t0, t1)]
        moves = _handoff_seconds((tmp / "scheduler.log").read_text(errors="replace"))
        samples = scrape(port)
        channel.close()
        return {
            "mode": mode,
            "p50": _pct(gaps, 0.5),
            "p99": _pct(gaps, 0.99),
            "max": max(gaps, default=0.0),
            "n_gaps": len(gaps),
            "ttft": statistics.mean(s.times[0] - s.sent for s in longs if s.times),
            "window": t1 - t0,
            "handed_off": total(samples, "llmserve:requests_handed_off_total"),
            "recomputed": total(samples, "llmserve:prompt_tokens_recomputed_total"),
            "outputs": [s.tokens for s in streams],
            "moves": moves,
            "errors": sum(s.error is not None for s in streams + longs),
        }
    finally:
        a.stop()
        b.stop()
        redis.close()


def _moves(moves: list[tuple[float, float]]) -> str:
    if not moves:
        return "-"
    wait, move = max(w for w, _ in moves), max(m for _, m in moves)
    return f"{len(moves)}, {1e3 * wait:.1f} / {1e3 * move:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["tiny", "demo"], default="demo")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--warm-tokens", type=int, default=10)
    p.add_argument("--long", type=int, default=8)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=4)
    p.add_argument("--every", type=float, default=0.25)
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="pd,colocated")
    args = p.parse_args()
    cache = Path(tempfile.gettempdir()) / "llmserve-bench-models"
    model_dir = demo_model_dir(cache, size=args.size)
    print("| mode | decode ITL p50 (ms) | p99 (ms) | max (ms) | gaps | long-prompt TTFT (s) "
          "| window (s) | handed off | recomputed | same output | errors "
          "| handoff batches: n, max lock wait / max move (ms) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    reference = None
    for _ in range(args.rounds):  # modes interleaved: a noisy machine affects each alike
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "run").mkdir()
                r = one_run(args, mode, Path(d) / "run", model_dir)
            reference = reference or r["outputs"]
            print(
                f"| {mode} | {1e3 * r['p50']:.1f} | {1e3 * r['p99']:.1f} | {1e3 * r['max']:.1f} "
                f"| {r['n_gaps']} | {r['ttft']:.3f} | {r['window']:.2f} | {r['handed_off']:.0f} "
                f"| {r['recomputed']:.0f} | {r['outputs'] == reference} | {r['errors']} "
                f"| {_moves(r['moves'])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
