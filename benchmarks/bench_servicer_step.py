#!/usr/bin/env python3
"""The executor's whole ExecuteModel step in process (validation, diffs, the runner's step,
recording, the reply: ``ExecutorServicer._execute``), this working tree against another commit,
alternated in one run. Decode steps through the decode lane at each batch size, on the small
demo model, where the Python around the forward weighs most: used for issue 43, whose feature
hooks must not show.

Each round starts one worker process per side (ABAB...), which imports ``executor_svc`` from
its side's tree; the table gives the medians over rounds and the spread (max - min) of each.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_servicer_step.py 9aedca8 \
        [--batches 1,64] [--rounds 7] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ab_shared import alternate_sides, decode_step, prefilled_servicer

BLOCK_SIZE = 16


def worker(tree: str, batches: list[int], context: int, steps: int, clock: str) -> None:
    sys.path.insert(0, tree)
    import torch

    from executor_svc.config.logs import configure_logging
    from executor_svc.demo.demo_model import ensure_demo_model
    from executor_svc.runner.model_runner import ModelRunner

    assert Path(sys.modules["executor_svc"].__file__).is_relative_to(tree)
    torch.set_num_threads(1)
    configure_logging("warning")  # step.done is a debug line a step
    warm = 5
    blocks_per_seq = -(-(context + warm + steps + 2) // BLOCK_SIZE)
    runner = ModelRunner(
        ensure_demo_model(), device="cpu", block_size=BLOCK_SIZE, swap_space_gib=0.01,
        num_device_blocks=max(batches) * blocks_per_seq + 1,
    )  # fmt: skip
    out = {}
    for b in batches:
        svc, ids = prefilled_servicer(runner, b, context, blocks_per_seq)
        for k in range(warm):
            decode_step(svc, 2 + k, ids, context + k)
        now = time.process_time if clock == "cpu" else time.perf_counter
        start = now()
        for k in range(steps):
            decode_step(svc, 2 + warm + k, ids, context + warm + k)
        out[str(b)] = (now() - start) / steps * 1e3
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("commit")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the process's CPU time (one torch thread), which other work on a shared "
        "machine disturbs far less than the wall clock",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)  # the tree to import from
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        worker(args.worker, batches, args.context, args.steps, args.clock)
        return
    argv = [__file__, args.commit, "--batches", args.batches, "--context", str(args.context),
            "--steps", str(args.steps), "--clock", args.clock]  # fmt: skip
    times = alternate_sides(args.commit, args.rounds, argv, [str(b) for b in batches])
    print(f"\ncontext {args.context}, {args.steps} steps a round, {args.clock} time, medians of "
          f"{args.rounds} rounds")  # fmt: skip
    print(f"| batch | {args.commit} ms (spread) | working tree ms (spread) | old / new |")
    print("| ---: | ---: | ---: | ---: |")
    for c in map(str, batches):
        old, new = (t[c] for t in times.values())
        o, n = statistics.median(old), statistics.median(new)
        print(
            f"| {c} | {o:.3f} ({max(old) - min(old):.3f}) | {n:.3f} ({max(new) - min(new):.3f}) "
            f"| {o / n:.3f} |"
        )


if __name__ == "__main__":
    main()
