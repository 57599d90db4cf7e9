"""How long a drain pauses the streams: live migration against recompute (issue 47).

Real processes on loopback: Redis, executors A and B on a demo model, the scheduler. B is paused
(SIGSTOP) until the health probe marks it down, so that `--streams` streams start on A alone;
it comes back idle, then A gets SIGTERM after `--warm-tokens` tokens per stream. Per mode:

- `migrate`: the default; A drains (--drain-timeout 60) and its running requests move to B
  with their KV cache (both on loopback: through shared memory);
- `migrate-grpc`: the same with --migrate-transport grpc (the bytes relayed through the
  scheduler in the gRPC streams, as between hosts);
- `migrate-push`: the same with --migrate-transport push (A streams the bytes to B itself,
  PushKV; the scheduler only asks);
- `recompute`: --no-migrate-on-drain, A with --drain-timeout 0.2: what is left when A stops is
  recomputed on B (the path without migration when the drain is short);
- `finish`: --no-migrate-on-drain, A with --drain-timeout 60: A finishes its streams in place.

Reported per run: the time from SIGTERM until the scheduler logged that A's requests moved
(`executor.migrated`, or `executor.failed_over` when A is gone and the rest is recomputed),
until the last stream continued on B (per stream, its first token after that; the latest of
those), the longest gap between two of a stream's tokens after SIGTERM (max and median over the
streams), the time until A's process is gone, the tokens
recomputed (`llmserve:prompt_tokens_recomputed`), requests migrated, and whether every stream's
output equals the undisturbed reference (run on A alone first).

    python benchmarks/bench_migration.py [--size tiny|demo] [--streams 32] [--tokens 400]
        [--warm-tokens 40] [--rounds 2] [--modes migrate,migrate-grpc,migrate-push,recompute,finish]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from protos import scheduler_pb2 as pb
from scheduler_svc.local.redis_server import RedisServer
from tests.support.api_helpers import collect, mixed_workload, run_in_threads, stub_for
from tests.support.prom import free_port, scrape, total
from tests.support.stack import demo_model_dir, start_two_executor_stack

MODES = {
    "migrate": ([], "60"),
    "migrate-grpc": (["--migrate-transport", "grpc"], "60"),
    "migrate-push": (["--migrate-transport", "push"], "60"),
    "recompute": (["--no-migrate-on-drain"], "0.2"),
    "finish": (["--no-migrate-on-drain"], "60"),
}
EXECUTOR_ARGS = ["--num-device-blocks", "1024", "--swap-space", "0.01"]


class Stream:
    """One streaming Generate in a thread: its tokens and when each delta came."""

    def __init__(self, stub, req) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(stub, req))
        self.thread.start()

    def _run(self, stub, req) -> None:
        try:
            for msg in stub.Generate(req, timeout=600):
                if msg.token_ids:
                    self.tokens.extend(msg.token_ids)
                    self.times.append(time.time())
        except Exception as e:  # noqa: BLE001 -- reported
            self.error = e

    def longest_gap_after(self, t0: float) -> tuple[float, float] | None:
        """(gap, time of the delta that ended it) over the deltas after t0 (the one before t0
        included as the gap's start); None when the stream had ended by t0."""
        after = [i for i, t in enumerate(self.times) if t > t0]
        if not after:
            return None
        first = after[0]
        start = self.times[first - 1] if first else t0
        gaps = [(self.times[first] - start, self.times[first])]
        gaps += [(self.times[i] - self.times[i - 1], self.times[i]) for i in after[1:]]
        return max(gaps)


def _moved_at(log: str) -> float:
    """Wall time the scheduler logged that A's requests moved (migrated, or failed over to be
    recomputed); 0.0 when they did not move."""
    for line in log.splitlines():
        if "executor.migrated" in line or "executor.failed_over" in line:
            stamp = line.split()[0].replace("Z", "+00:00")
            return datetime.fromisoformat(stamp).timestamp()
    return 0.0


def wait_b(stub, address: str, healthy: bool) -> None:
    deadline = time.monotonic() + 60
    while True:
        info = {e.address: e for e in stub.GetServerInfo(pb.GetServerInfoRequest()).executors}
        if info[address].healthy == healthy:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} never became healthy={healthy}")
        time.sleep(0.02)


def one_run(args, mode: str, tmp: Path, model_dir: Path) -> dict:
    sched_extra, drain = MODES[mode]
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    port = free_port()
    stack, leaving = _start(
        tmp, redis, model_dir, drain, [*sched_extra, "--metrics-port", str(port)]
    )
    b = stack.executor_proc
    try:
        channel, stub = stub_for(stack.address)
        b.send_signal(signal.SIGSTOP)
        wait_b(stub, stack.executor_address, healthy=False)
        reqs = mixed_workload("ref", args.streams, args.tokens, rng_seed=3, max_prompt_len=64)
        reference = run_in_threads([lambda r=r: collect(stub.Generate(r)) for r in reqs])
        reqs = mixed_workload("run", args.streams, args.tokens, rng_seed=3, max_prompt_len=64)
        streams = [Stream(stub, r) for r in reqs]
        while min(len(s.tokens) for s in streams) < args.warm_tokens:
            time.sleep(0.005)
        b.send_signal(signal.SIGCONT)
        wait_b(stub, stack.executor_address, healthy=True)
        t0 = time.time()
        leaving.executor_proc.send_signal(signal.SIGTERM)
        leaving.executor_proc.wait(timeout=600)
        a_gone = time.time() - t0
        for s in streams:
            s.thread.join(timeout=600)
        gaps = [g for s in streams if (g := s.longest_gap_after(t0)) is not None]
        moved_at = _moved_at((stack.workdir / "scheduler.log").read_text(errors="replace"))
        later = [next((t for t in s.times if t > moved_at), None) for s in streams]
        samples = scrape(port)
        channel.close()
        return {
            "mode": mode,
            "moved_s": moved_at - t0 if moved_at else None,
            "last_continued_s": max(t for t in later if t is not None) - t0 if moved_at else None,
            "max_gap_s": max(g for g, _ in gaps) if gaps else 0.0,
            "median_gap_s": statistics.median(g for g, _ in gaps) if gaps else 0.0,
            "a_gone_s": a_gone,
            "recomputed": total(samples, "llmserve:prompt_tokens_recomputed_total"),
            "migrated": total(samples, "llmserve:requests_migrated_total"),
            "identical": all(
                s.error is None and s.tokens == ref.tokens[0]
                for s, ref in zip(streams, reference, strict=True)
            ),
        }
    finally:
        stack.stop()
        leaving.stop()
        redis.close()


def _start(tmp: Path, redis, model_dir: Path, drain: str, scheduler_args: list[str]):
    return start_two_executor_stack(
        tmp,
        redis,
        EXECUTOR_ARGS,
        second_args=[*EXECUTOR_ARGS, "--drain-timeout", drain],
        scheduler_args=["--executor-failover", "600", "--log-level", "info", *scheduler_args],
        model_dir=model_dir,
    )


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["tiny", "demo"], default="tiny")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--warm-tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default="migrate,migrate-grpc,migrate-push,recompute,finish")
    args = p.parse_args()
    cache = Path(tempfile.gettempdir()) / "llmserve-bench-models"
    model_dir = demo_model_dir(cache, size=args.size)
    print("| mode | SIGTERM → moved (s) | SIGTERM → last stream continues on B (s) | longest "
          "stall max / median (s) | A gone (s) | tokens recomputed | migrated | identical |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for _ in range(args.rounds):  # modes interleaved: a noisy machine affects each alike
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "run").mkdir()
                r = one_run(args, mode, Path(d) / "run", model_dir)
            print(
                f"| {r['mode']} | {_s(r['moved_s'])} | {_s(r['last_continued_s'])} | {r['max_gap_s']:.3f} / "
                f"{r['median_gap_s']:.3f} | {r['a_gone_s']:.2f} | {r['recomputed']:.0f} | "
                f"{r['migrated']:.0f} | {r['identical']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
