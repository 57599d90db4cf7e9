#!/usr/bin/env python3
"""Where a mixed CPU step goes: 25 decodes with contexts of 120-900 tokens plus two 200-token
prefills on a model directory, timed, then the top ops of one step under torch.profiler.

    .venv/bin/python -m executor_svc.demo.demo_model /tmp/demo
    PYTHONPATH=. .venv/bin/python benchmarks/profile_mixed_step.py /tmp/demo
"""

from __future__ import annotations

import random
import sys
import time

import torch

from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence
from executor_svc.runner.sampler import SamplingParams


def _timed(runner: ModelRunner, seqs: list[ScheduledSequence], n: int = 5) -> float:
    start = time.perf_counter()
    for _ in range(n):
        runner.execute(seqs, [], [], [])
    return (time.perf_counter() - start) / n * 1e3


def main(model_dir: str) -> None:
    runner = ModelRunner(model_dir, device="cpu", num_device_blocks=4096, swap_space_gib=0.01)
    rng = random.Random(0)
    params = SamplingParams()
    cached, fresh, block = [], [], 0
    for i in range(27):
        ctx = rng.choice([120, 200, 260, 330, 500, 900]) if i < 25 else 200
        tokens = [(i * 7 + j) % 4000 + 5 for j in range(ctx)]
        nb = -(-(ctx + 1) // runner.block_size)
        table = list(range(block, block + nb))
        block += nb
        (cached if i < 25 else fresh).append(
            ScheduledSequence(str(i), tokens, ctx, table, 0, ctx, params)
        )
    for s in cached:  # their prompts into the cache, one at a time
        runner.execute([s], [], [], [])
    decode = [
        ScheduledSequence(s.seq_id, [*s.token_ids, 7], s.num_prompt_tokens, s.block_table,
                          len(s.token_ids), 1, params)
        for s in cached
    ]  # fmt: skip
    step = decode + fresh
    _timed(runner, step, 2)  # warm-up
    print(f"mixed step ({sum(s.num_scheduled_tokens for s in step)} tokens): "
          f"{_timed(runner, step):.1f} ms")  # fmt: skip
    print(f"its 25 decodes alone: {_timed(runner, decode):.1f} ms")
    print(f"its 2 prefills alone: {_timed(runner, fresh):.1f} ms")
    with torch.profiler.profile() as prof:
        runner.execute(step, [], [], [])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main(sys.argv[1])
