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
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16


def worker(tree: str, batches: list[int], context: int, steps: int, clock: str) -> None:
    sys.path.insert(0, tree)
    import torch

    from executor_svc.api.service import ExecutorServicer
    from executor_svc.config.logs import configure_logging
    from executor_svc.demo.demo_model import ensure_demo_model
    from executor_svc.runner.model_runner import ModelRunner
    from protos import executor_pb2 as pb

    assert Path(sys.modules["executor_svc"].__file__).is_relative_to(tree)
    torch.set_num_threads(1)
    configure_logging("warning")  # step.done is a debug line a step
    warm = 5
    blocks_per_seq = -(-(context + warm + steps + 2) // BLOCK_SIZE)
    runner = ModelRunner(
        ensure_demo_model(), device="cpu", block_size=BLOCK_SIZE, swap_space_gib=0.01,
        num_device_blocks=max(batches) * blocks_per_seq + 1,
    )  # fmt: skip
    rng = random.Random(0)
    out = {}
    for b in batches:
        svc = ExecutorServicer(runner)
        ids = [f"s{i}" for i in range(b)]
        new = [
            pb.NewSequence(
                seq_id=sid,
                token_ids=[rng.randrange(5, runner.info.vocab_size) for _ in range(context)],
                num_prompt_tokens=context,
                sampling_params=pb.SamplingParams(),
                block_table=range(i * blocks_per_seq, (i + 1) * blocks_per_seq),
                num_scheduled_tokens=context,
            )
            for i, sid in enumerate(ids)
        ]
        svc._execute(pb.ExecuteModelRequest(step_id=1, new_sequences=new))  # noqa: SLF001

        def decode(step_id: int, nc: int, ids: list[str] = ids) -> pb.ExecuteModelRequest:
            return pb.ExecuteModelRequest(
                step_id=step_id, decode_seq_ids=ids, decode_num_computed_tokens=[nc] * len(ids)
            )

        for k in range(warm):
            svc._execute(decode(2 + k, context + k))  # noqa: SLF001
        now = time.process_time if clock == "cpu" else time.perf_counter
        start = now()
        for k in range(steps):
            svc._execute(decode(2 + warm + k, context + warm + k))  # noqa: SLF001
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
    base = Path(tempfile.mkdtemp())
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base),
                    args.commit], check=True)  # fmt: skip
    sides = {args.commit: str(base), "working tree": str(ROOT)}
    times: dict[str, dict[str, list[float]]] = {s: {str(b): [] for b in batches} for s in sides}
    try:
        for rnd in range(args.rounds):
            for side, tree in sides.items():
                cmd = [sys.executable, __file__, args.commit, "--worker", tree, "--batches",
                       args.batches, "--context", str(args.context), "--steps",
                       str(args.steps), "--clock", args.clock]  # fmt: skip
                res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tree)
                for case, ms in json.loads(res.stdout.strip().splitlines()[-1]).items():
                    times[side][case].append(ms)
            print(f"round {rnd}: " + ", ".join(
                f"{s} b{c} {t[c][-1]:.3f} ms" for s, t in times.items() for c in t
            ), flush=True)  # fmt: skip
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)])
    print(f"\ncontext {args.context}, {args.steps} steps a round, {args.clock} time, medians of "
          f"{args.rounds} rounds")  # fmt: skip
    print(f"| batch | {args.commit} ms (spread) | working tree ms (spread) | old / new |")
    print("| ---: | ---: | ---: | ---: |")
    for c in map(str, batches):
        old, new = (times[s][c] for s in sides)
        o, n = statistics.median(old), statistics.median(new)
        print(
            f"| {c} | {o:.3f} ({max(old) - min(old):.3f}) | {n:.3f} ({max(new) - min(new):.3f}) "
            f"| {o / n:.3f} |"
        )


if __name__ == "__main__":
    main()
