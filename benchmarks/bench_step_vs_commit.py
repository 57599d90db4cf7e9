#!/usr/bin/env python3
"""Decode step time of this working tree against another commit, alternated in one run.

The other commit is checked out in a temporary git worktree. Each round starts one worker
process per side (ABAB...), which imports ``executor_svc`` from its side's tree, loads the
SmolLM-135M-shaped random Llama (fp32, ``auto`` attention backend, weights packed as that side
packs them) and times ``--steps`` decode steps at each batch size; the table gives the medians
over rounds. Used for issue 24: the step-invariant path against the code before it.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_step_vs_commit.py 917db5a \
        [--batches 1,64] [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ab_shared import ROOT, alternate_sides


def worker(
    tree: str, batches: list[int], context: int, threads: int, steps: int, prefill: int, clock: str
) -> None:
    sys.path.insert(0, tree)
    # executor_svc first: the benchmark helpers below put this tree's root on sys.path too.
    # By that tree's layout (an ImportError cannot tell: the editable install's finder would
    # find a missing subpackage in this checkout instead).
    if (Path(tree) / "executor_svc" / "runner").is_dir():
        from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence
    else:  # a tree from before executor_svc was laid out by role (issue 25)
        from executor_svc.model_runner import ModelRunner, ScheduledSequence  # type: ignore

    # That tree's own helpers (they import executor_svc by that tree's module paths).
    sys.path.insert(1, str(Path(tree) / "benchmarks"))
    import profile_step
    import torch
    from bench_vs_hf import build_model

    assert Path(sys.modules["executor_svc"].__file__).is_relative_to(tree)
    torch.set_num_threads(threads)
    blocks = max(max(batches) * -(-(context + 2) // 16), -(-prefill // 16)) + 16
    runner = ModelRunner(
        build_model(ROOT / ".cache"), device="cpu", num_device_blocks=blocks,
        swap_space_gib=0.01, attention_backend="auto",
    )  # fmt: skip
    now = time.process_time if clock == "cpu" else time.perf_counter
    out = {}
    for b in batches:
        seqs = profile_step.decode_batch(runner, b, context)
        for _ in range(2):  # warm
            runner.execute(seqs, [], [], [])
        start = now()
        for _ in range(steps):
            runner.execute(seqs, [], [], [])
        out[str(b)] = (now() - start) / steps * 1e3
    if prefill:  # one sequence's whole prompt in one step, computed again each time
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(5, runner.info.vocab_size, (prefill,), generator=g).tolist()
        params = profile_step.SamplingParams()
        seq = ScheduledSequence("p", tokens, prefill, list(range(-(-prefill // 16))), 0, prefill,
                                params)  # fmt: skip
        runner.execute([seq], [], [], [])
        start = now()
        for _ in range(max(1, steps // 4)):
            runner.execute([seq], [], [], [])
        out[f"prefill {prefill}"] = (now() - start) / max(1, steps // 4) * 1e3
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("commit")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefill", type=int, default=0, help="also time a prefill of this many tokens")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time (all its threads), which other work on a shared "
        "machine disturbs far less than the wall clock",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)  # the tree to import from
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        worker(
            args.worker, batches, args.context, args.threads, args.steps, args.prefill, args.clock
        )
        return
    argv = [__file__, args.commit, "--batches", args.batches, "--context", str(args.context),
            "--threads", str(args.threads), "--steps", str(args.steps), "--prefill",
            str(args.prefill), "--clock", args.clock]  # fmt: skip
    cases = [str(b) for b in batches] + ([f"prefill {args.prefill}"] if args.prefill else [])
    times = alternate_sides(args.commit, args.rounds, argv, cases)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((ln for ln in cpuinfo if ln.startswith("flags")), "").split()
    print(f"\nthreads={args.threads}, context {args.context}, {args.clock} time, medians of "
          f"{args.rounds} rounds")  # fmt: skip
    print("cpu flags: " + " ".join(f for f in flags if f.startswith(("avx", "amx", "fma"))))
    print(f"| step (batch) | {args.commit} ms | working tree ms | tok/s ratio (new / old) |")
    print("| ---: | ---: | ---: | ---: |")
    for c in cases:
        old, new = (statistics.median(t[c]) for t in times.values())
        print(f"| {c} | {old:.2f} | {new:.2f} | {old / new:.3f} |")


if __name__ == "__main__":
    main()
