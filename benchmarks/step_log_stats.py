#!/usr/bin/env python3
"""Executor step times from its debug log (`step.done` lines): decode-only steps against steps
that also carry prefill tokens, and how busy the executor was.

    benchmarks/step_log_stats.py /tmp/frontend-overhead/stack.log [--num-seqs 64]

Busy fraction: each `step.done` line carries the step's busy time (`ms`) and, in its ISO
timestamp, when it ended; over a run of consecutive decode-only steps at `--num-seqs`
sequences, busy = sum of their times / (end of the last - start of the first). The rest is the
executor waiting for the next `ExecuteModel` (scheduler work, gRPC, output handling not
overlapped with the forward).
"""

from __future__ import annotations

import argparse
import re
import statistics
from datetime import datetime
from pathlib import Path

_FIELDS = re.compile(r"(num_seqs|num_tokens|ms)=([0-9.]+)")
_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z?")


def read_steps(path: str | Path) -> list[dict[str, float]]:
    steps = []
    with open(path, errors="replace") as f:
        for line in f:
            if "step.done" not in line:
                continue
            d = {k: float(v) for k, v in _FIELDS.findall(line)}
            stamp = _STAMP.search(line)
            if stamp:
                d["end"] = datetime.fromisoformat(stamp.group(1)).timestamp()
            steps.append(d)
    return steps


def busy_fraction(path: str | Path, num_seqs: int = 64) -> str:
    """The executor's busy share over its longest run of decode-only steps at `num_seqs`."""
    steps = read_steps(path)
    best: list[dict[str, float]] = []
    run: list[dict[str, float]] = []
    for d in steps:
        if d["num_seqs"] == num_seqs == d["num_tokens"] and "end" in d:
            run.append(d)
            if len(run) > len(best):
                best = list(run)
        else:
            run = []
    if len(best) < 3:
        return f"no run of decode-only steps at {num_seqs} sequences in {path}"
    # The first step's own time is inside the window only from its end: start at its end.
    window = best[-1]["end"] - best[0]["end"]
    busy = sum(d["ms"] for d in best[1:]) / 1e3
    gaps = window - busy
    return (
        f"steady decode at {num_seqs} seqs: {len(best)} steps, mean step {busy / (len(best) - 1) * 1e3:.2f} ms, "
        f"mean idle between steps {gaps / (len(best) - 1) * 1e3:.2f} ms, executor busy {busy / window:.1%}"
    )


def summary(path: str | Path) -> str:
    """Steps, busy seconds, and decode-only against steps carrying prefill tokens."""
    steps = [d for d in read_steps(path) if d.get("num_seqs")]
    decode = [d for d in steps if d["num_seqs"] == d["num_tokens"]]
    mixed = [d for d in steps if d["num_seqs"] != d["num_tokens"]]
    total = sum(d["ms"] for d in steps) / 1e3
    lines = [f"steps {len(steps)}, executor busy {total:.1f} s"]
    if steps and "end" in steps[0] and "end" in steps[-1]:
        wall = steps[-1]["end"] - steps[0]["end"] + steps[0]["ms"] / 1e3
        lines[0] += f" of {wall:.1f} s from the first step's start to the last step's end"
    for name, rows in (("decode-only", decode), ("with prefill", mixed)):
        if rows:
            lines.append(
                f"{name}: {len(rows)} steps, {sum(r['ms'] for r in rows) / 1e3:.1f} s, mean"
                f" {statistics.mean(r['ms'] for r in rows):.1f} ms,"
                f" mean {statistics.mean(r['num_seqs'] for r in rows):.1f} seqs,"
                f" mean {statistics.mean(r['num_tokens'] for r in rows):.0f} tokens"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("--num-seqs", type=int, default=64)
    args = p.parse_args()
    print(summary(args.log))
    print(busy_fraction(args.log, args.num_seqs))


if __name__ == "__main__":
    main()
