#!/usr/bin/env python3
"""Executor step times from its debug log (`step.done` lines): decode-only steps against steps
that also carry prefill tokens.

    benchmarks/step_log_stats.py /tmp/frontend-overhead/stack.log
"""

from __future__ import annotations

import re
import statistics
import sys

_FIELDS = re.compile(r"(num_seqs|num_tokens|ms)=([0-9.]+)")


def main(path: str) -> None:
    decode, mixed = [], []
    with open(path, errors="replace") as f:
        for line in f:
            if "step.done" not in line:
                continue
            d = {k: float(v) for k, v in _FIELDS.findall(line)}
            (decode if d["num_seqs"] == d["num_tokens"] else mixed).append(d)
    total = sum(d["ms"] for d in decode + mixed) / 1e3
    print(f"steps {len(decode) + len(mixed)}, executor busy {total:.1f} s")
    for name, rows in (("decode-only", decode), ("with prefill", mixed)):
        if rows:
            print(
                f"{name}: {len(rows)} steps, mean {statistics.mean(r['ms'] for r in rows):.1f} ms,"
                f" mean {statistics.mean(r['num_seqs'] for r in rows):.1f} seqs,"
                f" mean {statistics.mean(r['num_tokens'] for r in rows):.0f} tokens"
            )


if __name__ == "__main__":
    main(sys.argv[1])
