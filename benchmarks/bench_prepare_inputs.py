"""Executor CPU per step outside the model: flattening a decode batch into tensors.

`ModelRunner.prepare_inputs` runs once per step on the host whatever the device; on a GPU it
sits between two forward passes, so its cost is pure overhead. This times it for decode steps
(one token per sequence) at several batch sizes and context lengths, on the tiny demo model
(the model does not matter here, only block size and batch shape), and, for comparison, the
block table built the way it was before: per-sequence Python lists into `torch.tensor`. The
executor now keeps each sequence's block ids in a growable int32 array (`BlockTable`) and copies
rows into a numpy buffer.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_prepare_inputs.py
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

from executor_svc.api.seq_state import BlockTable  # noqa: E402
from executor_svc.demo.demo_model import ensure_demo_model  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402

BLOCK_SIZE = 16


def decode_batch(num_seqs: int, context: int) -> list[ScheduledSequence]:
    num_blocks = -(-(context + 1) // BLOCK_SIZE)
    return [
        ScheduledSequence(
            seq_id=f"{i:032x}/0",
            token_ids=[5] * (context + 1),
            num_prompt_tokens=context,
            block_table=BlockTable(range(i * num_blocks, (i + 1) * num_blocks)),
            num_computed_tokens=context,
            num_scheduled_tokens=1,
            sampling_params=SamplingParams(),
        )
        for i in range(num_seqs)
    ]


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    model = ensure_demo_model(size="tiny")
    runner = ModelRunner(
        model, device="cpu", block_size=BLOCK_SIZE, num_device_blocks=8, attention_backend="torch"
    )
    print(
        "| seqs | context | prepare_inputs ms | of which block table ms | lists + torch.tensor ms |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for num_seqs in (64, 256):
        for context in (128, 1024, 4096):
            seqs = decode_batch(num_seqs, context)
            # The runner checks tables against max_model_len only; 8 real blocks suffice for
            # building inputs (nothing is run).
            runner.info.max_model_len = max(runner.info.max_model_len, context + 1)
            n = -(-(context + 1) // BLOCK_SIZE)
            total = timed(lambda s=seqs: runner.prepare_inputs(s), args.repeats)

            def new_table(s=seqs, n=n):
                import numpy as np

                table = np.zeros((len(s), n), dtype=np.int32)
                for i, q in enumerate(s):
                    table[i, :n] = q.block_table[:n]
                return torch.from_numpy(table)

            lists = [q.block_table.tolist() for q in seqs]

            def old_table(rows=lists, n=n):
                return torch.tensor([r[:n] for r in rows], dtype=torch.int32)

            print(
                f"| {num_seqs} | {context} | {total:.2f} | {timed(new_table, args.repeats):.2f} |"
                f" {timed(old_table, args.repeats):.2f} |"
            )


if __name__ == "__main__":
    main()
