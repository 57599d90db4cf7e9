#!/usr/bin/env python3
"""In-process batch-1 decode step (``ModelRunner.execute``, one torch thread) at several
context lengths, the lengths alternated over rounds so that drift of the machine shows up as
drift, not as a difference between lengths. SmolLM-135M-shaped random Llama, fp32, the
attention backend ``auto`` picks.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_b1_step.py [--contexts 192,560,1000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_step  # noqa: E402
from bench_vs_hf import build_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contexts", default="192,560,1000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per length and round")
    args = p.parse_args()
    torch.set_num_threads(1)
    runner = profile_step.make_runner(build_model(ROOT / ".cache"), "auto")
    cases = {c: profile_step.decode_batch(runner, 1, c) for c in map(int, args.contexts.split(","))}
    for rnd in range(args.rounds):
        for context, seqs in cases.items():
            for _ in range(3):  # warm
                runner.execute(seqs, [], [], [])
            start = time.perf_counter()
            for _ in range(args.steps):
                runner.execute(seqs, [], [], [])
            ms = (time.perf_counter() - start) / args.steps * 1e3
            print(f"round {rnd} context {context}: {ms:.2f} ms per step", flush=True)


if __name__ == "__main__":
    main()
