"""What a second OpenMP pool in the process costs a torch step (why executor_svc/api/compute.py
runs a pinned CPU executor's steps on one thread), without the executor.

A 30-layer step of matmul, SiLU and a norm (SmolLM2-135M's 576 x 1536 MLP shapes), timed when
it always runs from one thread (`one`: one pool), and when it alternates between two threads
(`two`: each thread that opens parallel regions has a pool of its own, and once the process
holds more OpenMP threads than CPUs libgomp stops letting idle workers spin). Each mode in a
process of its own, since a pool lives as long as its thread:

    for m in one two; do OMP_NUM_THREADS=2 python benchmarks/bench_omp_pools.py --mode $m; done
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Callable

import torch


class Worker:
    """A thread that runs what it is handed and reports the seconds each took."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.times: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn = self.jobs.get()
            t0 = time.perf_counter()
            fn()
            self.times.put(time.perf_counter() - t0)

    def run(self, fn: Callable[[], object]) -> float:
        self.jobs.put(fn)
        return self.times.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["one", "two"], required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    up = [torch.randn(576, 1536) for _ in range(30)]
    down = [torch.randn(1536, 576) for _ in range(30)]
    x0 = torch.randn(args.batch, 576)

    def step() -> None:
        x = x0
        for a, b in zip(up, down, strict=True):
            x = x + torch.nn.functional.silu(x @ a) @ b
            x = x / (x.norm(dim=-1, keepdim=True) + 1)

    a, b = Worker(), Worker()
    second = b if args.mode == "two" else a
    for _ in range(20):  # warm-up; in mode two, both threads' pools exist from here on
        a.run(step)
        second.run(step)
    medians = []
    for _ in range(args.rounds):
        medians.append(
            statistics.median((a if i % 2 == 0 else second).run(step) for i in range(args.steps))
        )
    print(
        f"mode={args.mode} threads={torch.get_num_threads()} batch={args.batch}: "
        f"{statistics.median(medians) * 1e3:.2f} ms a step (median of {args.rounds} round medians)"
    )


if __name__ == "__main__":
    main()
