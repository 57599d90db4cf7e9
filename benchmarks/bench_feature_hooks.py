#!/usr/bin/env python3
"""What the executor's feature hooks (features/base.py) cost a plain decode step, measured in one
process: the same runner and servicer with their features and with none (``Features()``),
alternated block by block, so the machine's drift falls on both alike. Batch-1 and batch-64
decode steps through the decode lane of ``ExecutorServicer._execute`` (validation to reply) on
the small demo model, where the Python around the forward weighs most; and the hooks alone
(``Features.active`` plus the validate hooks) timed on their own. Used for issue 43.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_feature_hooks.py \
        [--batches 1,64] [--blocks 40] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from ab_shared import ROOT, decode_step, prefilled_servicer

sys.path.insert(0, str(ROOT))

from executor_svc.config.logs import configure_logging  # noqa: E402
from executor_svc.demo.demo_model import ensure_demo_model  # noqa: E402
from executor_svc.features.base import Features  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16
CONTEXT = 32


def run(batch: int, blocks: int, steps: int) -> tuple[list[float], list[float], float]:
    """Per-step ms of (with features, without) per block, and the hooks' own µs a step."""
    per_seq = -(-(CONTEXT + 2 * blocks * steps + 8) // BLOCK_SIZE)
    runner = ModelRunner(
        ensure_demo_model(), device="cpu", block_size=BLOCK_SIZE, swap_space_gib=0.01,
        num_device_blocks=batch * per_seq + 1,
    )  # fmt: skip
    svc, ids = prefilled_servicer(runner, batch, CONTEXT, per_seq)
    state = {"step": 1, "nc": CONTEXT}

    def step() -> None:
        state["step"] += 1
        decode_step(svc, state["step"], ids, state["nc"])
        state["nc"] += 1

    full, none = runner.features, Features()
    for _ in range(3):
        step()
    on: list[float] = []
    off: list[float] = []
    for k in range(2 * blocks):
        runner.features = full if k % 2 == 0 else none
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        (on if k % 2 == 0 else off).append((time.perf_counter() - t0) / steps * 1e3)
    runner.features = full
    # The hooks alone: what a decode step of this batch asks of them.
    seqs = [s for s in svc._seqs.values()]  # noqa: SLF001
    views = [type("V", (), {})() for _ in seqs]
    for v, s in zip(views, seqs, strict=True):
        v.step_data = None
        v.features, v.sampling_params = None, s.sampling_params
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        full.active(views)
    return on, off, (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--blocks", type=int, default=40, help="blocks of steps per side")
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    args = p.parse_args()
    torch.set_num_threads(1)
    configure_logging("warning")  # step.done is a debug line a step
    print("| batch | with features ms (IQR) | without ms (IQR) | with / without | active() µs |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for b in map(int, args.batches.split(",")):
        on, off, hooks_us = run(b, args.blocks, args.steps)
        q_on, q_off = statistics.quantiles(on, n=4), statistics.quantiles(off, n=4)
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(
            f"| {b} | {m_on:.3f} ({q_on[2] - q_on[0]:.3f}) | {m_off:.3f} "
            f"({q_off[2] - q_off[0]:.3f}) | {m_on / m_off:.3f} | {hooks_us:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
