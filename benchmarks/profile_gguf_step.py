#!/usr/bin/env python3
"""Where a batch-1 decode step of a GGUF model goes, by op family (profile_step.py's timers on a
real model): the quantized matmuls (every ``Linear``; the lm_head under logits), attention
(rope + K/V write + paged attention, one kernel call per layer), norms, the sampler, input
preparation, and the rest (embedding lookup, SiLU, residuals, the Python between ops). Thread
CPU time, one torch thread, the context tokens already in the cache.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/profile_gguf_step.py \\
        --model FILE.gguf [--context 512] [--iters 30]
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_step  # noqa: E402

from executor_svc.api.server import resolve_model  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a .gguf file (or any --model the server takes)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    # The family timers and the step on thread CPU time: waiting for a shared core not counted.
    profile_step.time = types.SimpleNamespace(perf_counter=time.thread_time)  # type: ignore
    model_dir, _ = resolve_model(args.model)
    runner = ModelRunner(model_dir, device="cpu", num_device_blocks=256, swap_space_gib=0.01)
    profile_step.instrument(runner)
    seqs = profile_step.decode_batch(runner, 1, args.context)
    rows = {
        f"decode x1 @ {args.context}, round {r}": profile_step.profile(runner, seqs, args.iters)
        for r in range(args.rounds)
    }
    print(f"{args.model}: backend={runner.backend.name}, thread CPU time")
    profile_step.print_table(rows)


if __name__ == "__main__":
    main()
