#!/usr/bin/env python3
"""A whole decode step (``ModelRunner.execute``: prepare, forward, logits, greedy sampling) under
one kernel variant, one torch thread: the SmolLM-135M-shaped random Llama of bench_vs_hf, batch
1 and 64, every sequence with ``--context`` tokens in its cache. The variants
(``$LLMSERVE_CPU_ISA`` values) alternate inside one process, round after round, on the same
prefilled cache; medians of the rounds. ``--tree`` puts another checkout first on the path
(before/after: one run per tree).

    HF_HUB_OFFLINE=1 taskset -c 1 .venv/bin/python benchmarks/bench_variant_step.py \\
        [--variants avx2,avx512] [--dtype float32|bfloat16] [--tree DIR]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", default=str(HERE.parent))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default="avx2,avx512")
    args = p.parse_args()
    sys.path.insert(0, args.tree)
    import torch

    from executor_svc.kernels import library
    from executor_svc.runner.model_runner import ModelRunner

    sys.path.insert(1, str(HERE))  # the helpers put this tree first: import them after
    profile_step = importlib.import_module("profile_step")
    build_model = importlib.import_module("bench_vs_hf").build_model

    torch.set_num_threads(1)
    runner = ModelRunner(
        build_model(HERE.parent / ".cache"), device="cpu", num_device_blocks=1024,
        swap_space_gib=0.01, attention_backend="auto", dtype=args.dtype,
    )  # fmt: skip
    variants = args.variants.split(",")
    print(f"dtype {args.dtype}, tree {args.tree}, context {args.context}")
    print(f"| decode step ms | {' | '.join(variants)} |")
    for batch in (1, 64):
        seqs = profile_step.decode_batch(runner, batch, args.context)
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name in variants:
                os.environ["LLMSERVE_CPU_ISA"] = name
                library.reset()
                assert library.variant() == name, name
                runner.execute(seqs, [], [], [])  # warm
                start = time.perf_counter()
                for _ in range(args.steps):
                    runner.execute(seqs, [], [], [])
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
        row = " | ".join(f"{statistics.median(times[v]):.1f}" for v in variants)
        print(f"| batch {batch} | {row} |", flush=True)


if __name__ == "__main__":
    main()
