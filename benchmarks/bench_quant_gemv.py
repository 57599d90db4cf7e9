#!/usr/bin/env python3
"""The quantized matmul kernels (``kernels/quant.py``, csrc/quant_gemm.cpp) at one row (a
batch-1 decode) and a few rows, on the matmuls of SmolLM2-135M, one thread.

Every call reads the next of several copies of the weights (together > the L3), as a model
step does. Reported per (type, shape, rows): microseconds per call (median of rounds, thread CPU
time, so time waiting for a shared core is not counted), weights per nanosecond and GB/s of
blocks read; then the sum over one decode step of the model (30 layers + the lm_head).
``--hot`` keeps one copy (cache-resident for all but the lm_head): the kernel's compute alone.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_quant_gemv.py [--types Q4_1,Q8_0] [--rows 1,8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.kernels import quant  # noqa: E402

# (name, in, out, per step) of SmolLM2-135M's matmuls.
SHAPES = (
    ("qkv", 576, 960, 30),
    ("o", 576, 576, 30),
    ("gate_up", 576, 3072, 30),
    ("down", 1536, 576, 30),
    ("lm_head", 576, 49152, 1),
)


def random_weight(type_id: int, n: int, k: int, seed: int) -> quant.QuantWeight:
    """Random blocks with small finite fp16 scales (the byte offsets of each type's scales)."""
    rng = np.random.default_rng(seed)
    _, block, nbytes = quant.TYPES[type_id]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    name = quant.type_name(type_id)
    offsets = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[name]
    for off in offsets:
        scale = (rng.standard_normal((n, k // block, 1)) * 0.02).astype(np.float16)
        raw[..., off : off + 2] = scale.view(np.uint8)
    return quant.QuantWeight(torch.from_numpy(raw.reshape(n, -1)), type_id, k)


def time_case(weights: list[quant.QuantWeight], x: torch.Tensor, seconds: float) -> float:
    """Thread CPU seconds per call over about ``seconds``, cycling over the copies."""
    for w in weights[:2]:
        w.linear(x, None)
    start, n, i = time.thread_time(), 0, 0
    while True:
        weights[i].linear(x, None)
        i = (i + 1) % len(weights)
        n += 1
        elapsed = time.thread_time() - start
        if elapsed >= seconds:
            return elapsed / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--types", default="Q4_1,Q8_0")
    p.add_argument("--rows", default="1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.2)
    p.add_argument("--hot", action="store_true", help="one copy of the weights (cache-resident)")
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in args.types.split(","):
        tid = quant.TYPE_IDS[name]
        for m in map(int, args.rows.split(",")):
            step_us = 0.0
            for shape, k, n, per_step in SHAPES:
                nbytes = n * quant.row_bytes(tid, k)
                copies = 1 if args.hot else max(1, -(-(96 << 20) // nbytes))
                weights = [random_weight(tid, n, k, seed) for seed in range(copies)]
                x = torch.randn(m, k)
                times = [time_case(weights, x, args.seconds) for _ in range(args.rounds)]
                sec = statistics.median(times)
                step_us += sec * 1e6 * per_step
                print(
                    f"{name} rows {m} {shape:8s} [{n}, {k}]: {sec * 1e6:9.1f} us  "
                    f"{n * k * m / sec / 1e9:6.2f} Gweight-rows/s  {nbytes / sec / 1e9:6.2f} GB/s",
                    flush=True,
                )
            print(f"{name} rows {m}: one SmolLM2 step (30 layers + lm_head) {step_us / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
