"""What the step benchmarks share (not a benchmark itself): running a worker against this working
tree and another commit, alternated in one run, and an executor servicer whose sequences are
prefilled and decode one token a step.

Imported by the scripts beside it (run as `python benchmarks/<script>.py`, so this folder is on
sys.path). It imports no `executor_svc` at import time: a worker first puts its side's tree on
sys.path, and the servicer helpers then use that tree's modules.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def alternate_sides(
    commit: str, rounds: int, argv: list[str], cases: list[str]
) -> dict[str, dict[str, list[float]]]:
    """Check `commit` out in a temporary git worktree and, `rounds` times, run
    `python <argv> --worker <tree>` once per side (that commit first, then this working tree)
    with the side's tree as its cwd. A worker's last stdout line is JSON {case: ms}. Returns
    {side: {case: [ms of each round]}}, the commit's side first; each round is printed as it
    ends, so a long run shows progress."""
    base = Path(tempfile.mkdtemp())
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base),
                    commit], check=True)  # fmt: skip
    sides = {commit: str(base), "working tree": str(ROOT)}
    times: dict[str, dict[str, list[float]]] = {s: {c: [] for c in cases} for s in sides}
    try:
        for rnd in range(rounds):
            for side, tree in sides.items():
                cmd = [sys.executable, *argv, "--worker", tree]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=tree)
                for case, ms in json.loads(res.stdout.strip().splitlines()[-1]).items():
                    times[side][case].append(ms)
            print(f"round {rnd}: " + ", ".join(
                f"{s} {c} {t[c][-1]:.3f} ms" for s, t in times.items() for c in cases
            ), flush=True)  # fmt: skip
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)])
    return times


def prefilled_servicer(
    runner: Any, batch: int, context: int, blocks_per_seq: int, servicer: Any = None
) -> tuple[Any, list[str]]:
    """An ExecutorServicer (or `servicer`, another build's class) on `runner` that has run step
    1, the prefill of `batch` sequences of `context` random tokens (seeded), each with
    `blocks_per_seq` blocks; and their ids."""
    from executor_svc.api.service import ExecutorServicer
    from protos import executor_pb2 as pb

    svc = (servicer or ExecutorServicer)(runner)
    rng = random.Random(0)
    ids = [f"s{i}" for i in range(batch)]
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
    return svc, ids


def decode_step(svc: Any, step_id: int, ids: list[str], num_computed: int) -> None:
    """One decode step of the sequences `ids` (all at `num_computed` tokens) through the
    servicer's decode lane."""
    from protos import executor_pb2 as pb

    req = pb.ExecuteModelRequest(
        step_id=step_id, decode_seq_ids=ids, decode_num_computed_tokens=[num_computed] * len(ids)
    )
    svc._execute(req)  # noqa: SLF001
