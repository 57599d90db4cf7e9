#!/usr/bin/env python3
"""The executor's whole ExecuteModel step, another commit's ``executor_svc`` against this working
tree's, in ONE process: what ``bench_servicer_step.py`` measures, with the noise of two
processes (their heaps, their libraries' addresses, a loaded machine between runs) taken out.

The commit's ``executor_svc`` is extracted (``git archive``) into a temporary folder and renamed
``old_executor_svc`` (every ``executor_svc`` word in its .py files), so both trees import side by
side; both use this tree's ``protos`` (fine while the protos only gained fields). Each side gets
its runner on the demo model; rounds alternate (ABBA...), each a fresh prefilled servicer, 5
warm-up decode steps and ``--steps`` timed ones, each step timed alone (CPU time, one torch
thread). The table gives percentiles over all timed steps: a low one (p10, p25) is what the code
costs, the median adds what the machine did meanwhile. The replies' tokens must be equal.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_servicer_inprocess.py 168e636 \
        [--batch 1] [--rounds 80] [--steps 50]
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ab_shared import prefilled_servicer

ROOT = Path(__file__).resolve().parents[1]
OLD = "old_executor_svc"


def extract(commit: str, into: Path) -> None:
    """``commit``'s executor_svc as the package ``old_executor_svc`` under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "executor_svc"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "executor_svc").rename(into / OLD)
    for path in (into / OLD).rglob("*.py"):  # (csrc untouched: the kernel cache key stays)
        path.write_text(re.sub(r"\bexecutor_svc\b", OLD, path.read_text()))


def side(pkg: str, batch: int, blocks_per_seq: int) -> tuple[Any, Any]:
    """(a runner on the demo model, the servicer class) of package ``pkg``."""
    importlib.import_module(f"{pkg}.config.logs").configure_logging("warning")
    demo = importlib.import_module(f"{pkg}.demo.demo_model")
    runner_mod = importlib.import_module(f"{pkg}.runner.model_runner")
    runner = runner_mod.ModelRunner(
        demo.ensure_demo_model(), device="cpu", block_size=16, swap_space_gib=0.01,
        num_device_blocks=batch * blocks_per_seq + 1,
    )  # fmt: skip
    return runner, importlib.import_module(f"{pkg}.api.service").ExecutorServicer


def run_round(
    runner: Any, servicer: Any, batch: int, context: int, steps: int, bps: int
) -> tuple[list[float], list[list[int]]]:
    """A fresh prefilled servicer, 5 warm-up decode steps, then ``steps`` timed ones: each
    step's CPU µs and the lane's tokens."""
    from protos import executor_pb2 as pb

    svc, ids = prefilled_servicer(runner, batch, context, bps, servicer)
    times, tokens = [], []
    for k in range(5 + steps):
        req = pb.ExecuteModelRequest(
            step_id=2 + k, decode_seq_ids=ids, decode_num_computed_tokens=[context + k] * batch
        )
        t0 = time.process_time_ns()
        reply = svc._execute(req)  # noqa: SLF001
        if k >= 5:
            times.append((time.process_time_ns() - t0) / 1e3)
            tokens.append(list(reply.decode_token_ids))
    return times, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("commit")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    extract(args.commit, tmp)
    sys.path[:0] = [str(ROOT), str(tmp)]
    import torch

    torch.set_num_threads(1)
    bps = -(-(args.context + 5 + args.steps + 2) // 16)
    sides = {name: side(name, args.batch, bps) for name in (OLD, "executor_svc")}
    times: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            t, tok = run_round(*sides[name], args.batch, args.context, args.steps, bps)
            times[name] += t
            tokens[name].append(tok)

    def pct(v: list[float], q: float) -> float:
        return sorted(v)[int(q * (len(v) - 1))]

    print(f"\nbatch {args.batch}, context {args.context}, {args.rounds} rounds of {args.steps} "
          "steps a side, CPU µs a step")  # fmt: skip
    print("| side | p10 | p25 | p50 |\n| --- | ---: | ---: | ---: |")
    for name, label in ((OLD, args.commit), ("executor_svc", "working tree")):
        v = times[name]
        print(f"| {label} | {pct(v, 0.1):.1f} | {pct(v, 0.25):.1f} | {pct(v, 0.5):.1f} |")
    old, new = times[OLD], times["executor_svc"]
    ratios = ", ".join(f"p{int(q * 100)} {pct(old, q) / pct(new, q):.3f}" for q in (0.1, 0.25, 0.5))
    print(
        f"old / new (above 1: faster): {ratios}; same tokens: {tokens[OLD] == tokens['executor_svc']}"
    )


if __name__ == "__main__":
    main()
