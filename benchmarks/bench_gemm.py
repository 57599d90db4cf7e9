#!/usr/bin/env python3
"""The step-invariant CPU GEMM (``cpu_gemm.PanelWeight``, csrc/gemm.cpp) against oneDNN on
prepacked weights (``cpu_gemm.OneDnnWeight``, the non-deterministic path) and MKL
(``torch.matmul`` on the plain ``[in, out]`` matrix), on the matmuls of SmolLM2-135M.

Each (shape, rows, threads) case times the three implementations in alternated rounds (A B C,
A B C, ...) and reports medians, so drift of this shared machine lands on all three alike.
Every call reads the next of several copies of the weights (together > the 32 MiB L3), as a
model step does: one row is then bound by DRAM, reported in GB/s of weights read. ``--hot``
keeps one copy (cache-resident for all but the lm_head).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_gemm.py [--threads 1,2] [--rows 1,16,64,512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.kernels import gemm as cpu_gemm  # noqa: E402

# (name, in, out) of SmolLM2-135M's matmuls: hidden 576, intermediate 1536, 9 + 2 x 3 heads of 64.
SHAPES = (
    ("qkv", 576, 960),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
)
IMPLS = ("ours", "onednn", "mkl")


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line
    return "flags: unknown"


def make_calls(k: int, n: int, m: int, hot: bool) -> dict[str, Callable[[], object]]:
    """One callable per implementation, each cycling over its own copies of the weights."""
    copies = 1 if hot else max(1, -(-(96 << 20) // (k * n * 4)))
    g = torch.Generator().manual_seed(k + n)
    plain = [torch.randn(k, n, generator=g) for _ in range(copies)]
    x = torch.randn(m, k, generator=g)
    ours = [cpu_gemm.PanelWeight.pack(w) for w in plain]
    onednn = [cpu_gemm.OneDnnWeight.pack(w) for w in plain]

    def cycle(fn: Callable[[int], object]) -> Callable[[], object]:
        state = [0]

        def call() -> object:
            state[0] = (state[0] + 1) % copies
            return fn(state[0])

        return call

    return {
        "ours": cycle(lambda i: ours[i].linear(x, None)),
        "onednn": cycle(lambda i: onednn[i].linear(x, None)),  # type: ignore[union-attr]
        "mkl": cycle(lambda i: torch.matmul(x, plain[i])),
    }


def time_call(call: Callable[[], object], seconds: float) -> float:
    """Seconds per call over about ``seconds`` of calls (after two warm-up calls)."""
    call(), call()
    start, n = time.perf_counter(), 0
    while True:
        call()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", default="1,16,64,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.1, help="per implementation and round")
    p.add_argument("--hot", action="store_true", help="one copy of each weight (cache-resident)")
    p.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="over rounds (min: busy machine)",
    )
    args = p.parse_args()
    if not cpu_gemm.available():
        sys.exit("the CPU kernel library is not available (no C++ compiler?)")
    print(cpu_flags())
    stat = statistics.median if args.stat == "median" else min
    print(f"torch {torch.__version__}, {args.rounds} alternated rounds, {args.stat} of rounds\n")
    cols = ["threads", "matmul", "K x N", "M", "ours ms", "oneDNN ms", "MKL ms"]
    cols += ["ours", "oneDNN", "MKL", "ours / oneDNN"]
    print("| " + " | ".join(cols) + " |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, k, n in SHAPES:
            for m in map(int, args.rows.split(",")):
                calls = make_calls(k, n, m, args.hot)
                times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
                for _ in range(args.rounds):
                    for impl in IMPLS:
                        times[impl].append(time_call(calls[impl], args.seconds))
                med = {impl: stat(t) for impl, t in times.items()}
                # One row streams the weights: GB/s of them; more rows: GFLOP/s.
                unit, work = ("GB/s", k * n * 4) if m == 1 else ("GFLOP/s", 2 * m * k * n)
                rates = " | ".join(f"{work / med[i] / 1e9:.1f} {unit}" for i in IMPLS)
                ms = " | ".join(f"{med[i] * 1e3:.3f}" for i in IMPLS)
                ratio = med["ours"] / med["onednn"]
                print(f"| {threads} | {name} | {k} x {n} | {m} | {ms} | {rates} | {ratio:.3f} |")
                del calls


if __name__ == "__main__":
    main()
