#!/usr/bin/env python3
"""The one-call CPU decoder (models/cpu_decoder.py, csrc/decoder.cpp) against the per-layer
Python forward it replaces: ``ModelRunner.execute`` decode steps at each batch size, the
context already in the cache, one model loaded once, the two forwards alternated in rounds
(``LLMSERVE_CPU_FUSED_DECODER`` flipped between them). Thread CPU time per step; the best round
and every round are printed, with the CPU's flags.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 taskset -c 1 .venv/bin/python \\
        benchmarks/bench_cpu_decoder.py --model PATH [--batch 1,16,64] [--context 512]

``--model``: any checkpoint directory or .gguf file the executor takes, loaded in ``--dtype``
(float32, or bfloat16 for the bf16 decoder, csrc/decoder_bf16.cpp; issue 44).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gemm import cpu_flags  # noqa: E402
from profile_step import decode_batch  # noqa: E402

from executor_svc.api.server import resolve_model  # noqa: E402
from executor_svc.models import cpu_decoder  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner  # noqa: E402


def step_ms(runner: ModelRunner, seqs: list, fused: bool, iters: int) -> float:
    os.environ["LLMSERVE_CPU_FUSED_DECODER"] = "1" if fused else "0"
    cpu_decoder.reset(runner.model)
    for _ in range(2):
        runner.execute(seqs, [], [], [])
    taken = getattr(runner.model, "_cpu_decoder_plan", None) is not None
    assert taken == fused, "the fused decoder did not take this model" if fused else "not off"
    start = time.thread_time()
    for _ in range(iters):
        runner.execute(seqs, [], [], [])
    return (time.thread_time() - start) / iters * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    batches = [int(b) for b in args.batch.split(",")]
    model_dir, _ = resolve_model(args.model)
    per_seq = -(-(args.context + 2) // 16) + 1
    runner = ModelRunner(
        model_dir, device="cpu", dtype=args.dtype,
        num_device_blocks=max(batches) * per_seq + 16, swap_space_gib=0.01,
    )  # fmt: skip
    print(cpu_flags())
    print(
        f"{args.model} ({args.dtype}): decode step, context {args.context}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print("| batch | per-layer ms | one call ms | speed-up | rounds (per-layer / one call) |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for batch in batches:
        seqs = decode_batch(runner, batch, args.context)
        per_layer, fused = [], []
        for _ in range(args.rounds):
            per_layer.append(step_ms(runner, seqs, False, args.iters))
            fused.append(step_ms(runner, seqs, True, args.iters))
        rounds = " / ".join(", ".join(f"{t:.2f}" for t in r) for r in (per_layer, fused))
        best_p, best_f = min(per_layer), min(fused)
        print(f"| {batch} | {best_p:.2f} | {best_f:.2f} | {best_p / best_f:.2f}x | {rounds} |")


if __name__ == "__main__":
    main()
