#!/usr/bin/env python3
"""Decode step time with step-invariant numerics on and off, in one process, alternated.

Two ``ModelRunner``s on the SmolLM-135M-shaped random Llama (fp32, the ``auto`` attention
backend), one loaded with ``numerics.set_deterministic(True)`` (weights packed for the
step-invariant GEMM, csrc/gemm.cpp) and one with ``False`` (oneDNN on prepacked weights, as
``LLMSERVE_DETERMINISTIC=0``). Each round times ``--steps`` decode steps of each runner at each
batch size, the two runners alternated (A B A B ...), and the table gives the median over
rounds, so drift of this shared machine falls on both alike.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_numerics_step.py [--batches 1,64] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_step  # noqa: E402
from bench_vs_hf import build_model  # noqa: E402

from executor_svc.config import numerics  # noqa: E402
from executor_svc.kernels import gemm as cpu_gemm  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner  # noqa: E402


def make_runner(model_dir: Path, deterministic: bool, blocks: int) -> ModelRunner:
    numerics.set_deterministic(deterministic)  # read when the weights are packed, at load
    runner = ModelRunner(
        model_dir, device="cpu", num_device_blocks=blocks, swap_space_gib=0.01,
        attention_backend="auto",
    )  # fmt: skip
    kind = cpu_gemm.PanelWeight if deterministic else cpu_gemm.OneDnnWeight
    assert isinstance(runner.model.packed_lm_head, kind), type(runner.model.packed_lm_head)
    return runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per case and round")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * -(-(args.context + 2) // 16) + 16
    model_dir = build_model(ROOT / ".cache")
    runners = {mode: make_runner(model_dir, mode, blocks) for mode in (True, False)}
    cases = {
        (mode, b): profile_step.decode_batch(runners[mode], b, args.context)
        for mode in runners
        for b in batches
    }
    times: dict[tuple[bool, int], list[float]] = {case: [] for case in cases}
    for rnd in range(args.rounds):
        for b in batches:
            for mode in (True, False):
                runner, seqs = runners[mode], cases[(mode, b)]
                numerics.set_deterministic(mode)  # for anything that reads it per call
                for _ in range(2):  # warm
                    runner.execute(seqs, [], [], [])
                start = time.perf_counter()
                for _ in range(args.steps):
                    runner.execute(seqs, [], [], [])
                times[(mode, b)].append((time.perf_counter() - start) / args.steps * 1e3)
        print(f"round {rnd}: " + ", ".join(
            f"x{b} {'det' if m else 'onednn'} {t[-1]:.2f} ms" for (m, b), t in times.items()
        ), flush=True)  # fmt: skip
    print(f"\ntorch threads={args.threads}, context {args.context}, {args.rounds} rounds' medians")
    print("| batch | DETERMINISTIC=1 ms/step | DETERMINISTIC=0 ms/step | 1 / 0 |")
    print("| ---: | ---: | ---: | ---: |")
    for b in batches:
        on, off = statistics.median(times[(True, b)]), statistics.median(times[(False, b)])
        print(f"| {b} | {on:.2f} | {off:.2f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
