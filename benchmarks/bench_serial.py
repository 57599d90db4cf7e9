#!/usr/bin/env python3
"""The serial part of a CPU decode step (issue 44, "Many cores"): what runs on one thread
whatever the thread count, measured at one thread on one core.

The SmolLM2-135M-shaped random Llama (``--dtype`` bfloat16 or float32), decode steps of
``ModelRunner.execute`` through the one-call decoder (models/cpu_decoder.py) at each
``--batches`` size with ``--context`` tokens each in the cache. Thread CPU time (``--clock
wall``: elapsed time, for more than one thread) per step and per section of it, timed around:
``prepare`` (runner/inputs.py), ``embed`` (the embedding gather and the rope tables: the
model's forward before the decoder call), ``decoder`` (the one kernel call), ``logits`` (the
lm_head), ``sampler``; ``rest`` is the step less those (the runner's Python, the logits' cast
and row select, the results). Medians of ``--rounds`` rounds of ``--iters`` steps.

What inside ``decoder`` is serial (the glue between its kernels, norms below their parallel
threshold) is not timed: ``--perf`` records the measured steps alone with ``perf record`` (on
this process, from the first warm-up step to the last step of the batch) and prints the self
time of each symbol above ``--perf-min`` percent as ms a step (its share of the samples times
the median step).

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_serial.py \\
        [--dtype bfloat16] [--batches 1,64] [--context 192]

With ``T1`` the one-thread step and ``S`` its serial part, a step on N threads takes at least
``S + (T1 - S) / N`` (Amdahl).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_decode import SMOLLM_135M  # noqa: E402
from bench_gemm import cpu_flags  # noqa: E402

from executor_svc.kernels import library  # noqa: E402
from executor_svc.models import cpu_decoder, llama  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402
from tests.support.model_factory import make_tiny_checkpoint  # noqa: E402

SECTIONS = ("prepare", "embed", "decoder", "logits", "sampler")
TIMES: dict[str, float] = defaultdict(float)
CLOCK = {"thread": time.thread_time, "wall": time.perf_counter}
clock = time.thread_time


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += clock() - start

    return wrapper


def instrument() -> None:
    """Timers on each section's entry point; ``embed`` is the forward up to the decoder call
    (the forward's time less the decoder's)."""
    ModelRunner.prepare_inputs = _timed("prepare", ModelRunner.prepare_inputs)
    ModelRunner._sample = _timed("sampler", ModelRunner._sample)
    llama.LlamaForCausalLM.compute_logits = _timed("logits", llama.LlamaForCausalLM.compute_logits)
    llama.LlamaForCausalLM.forward = _timed("forward", llama.LlamaForCausalLM.forward)
    cpu_decoder.forward = _timed("decoder", cpu_decoder.forward)  # llama.py's call reads it


def decode_seqs(runner: ModelRunner, batch: int, context: int) -> list[ScheduledSequence]:
    """``batch`` decode rows, ``context`` tokens each in the (zero) cache."""
    per_seq = -(-(context + 1) // runner.block_size)
    g = torch.Generator().manual_seed(batch)
    seqs = []
    for i in range(batch):
        tokens = torch.randint(3, SMOLLM_135M["vocab_size"], (context + 1,), generator=g).tolist()
        table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(ScheduledSequence(str(i), tokens, context, table, context, 1, SamplingParams()))
    return seqs


def measure(runner: ModelRunner, seqs: list[ScheduledSequence], iters: int) -> dict[str, float]:
    for _ in range(2):
        runner.execute(seqs, [], [], [])
    TIMES.clear()
    start = clock()
    for _ in range(iters):
        runner.execute(seqs, [], [], [])
    row = {k: v / iters * 1e3 for k, v in TIMES.items()}
    row["step"] = (clock() - start) / iters * 1e3
    row["embed"] = row.pop("forward") - row["decoder"]
    row["rest"] = row["step"] - sum(row[k] for k in SECTIONS)
    return row


def perf_start(path: str) -> subprocess.Popen:
    cmd = ["perf", "record", "-q", "-F", "1999", "-o", path, "-p", str(os.getpid())]
    proc = subprocess.Popen(cmd)
    time.sleep(1.0)  # perf attaches
    return proc


def perf_report(proc: subprocess.Popen, path: str, step_ms: float, min_pct: float) -> None:
    """Each symbol's self time as ms a step, the kernel library's and the rest."""
    proc.send_signal(signal.SIGINT)
    proc.wait()
    report = subprocess.run(
        ["perf", "report", "-i", path, "--stdio", "--sort", "dso,sym", f"--percent-limit={min_pct}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for line in report.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pct, dso, _, sym = line.split(maxsplit=3)
        ms = float(pct.rstrip("%")) / 100 * step_ms
        print(f"  perf {ms:7.3f} ms {pct:>7} {dso[:28]:28} {sym[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--perf", default="", help="perf.data path prefix: profile each batch")
    p.add_argument("--perf-min", type=float, default=0.2, help="percent")
    p.add_argument(
        "--clock", choices=sorted(CLOCK), default="thread",
        help="thread: this thread's CPU time (one thread); wall: for more threads",
    )  # fmt: skip
    args = p.parse_args()
    global clock
    clock = CLOCK[args.clock]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    batches = [int(b) for b in args.batches.split(",")]
    instrument()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            Path(tmp) / "m", "llama", seed=0, tie_word_embeddings=True, **SMOLLM_135M
        )
        per_seq = -(-(args.context + 1) // 16)
        runner = ModelRunner(
            model_dir, device="cpu", dtype=args.dtype, block_size=16,
            num_device_blocks=max(batches) * per_seq + 8, swap_space_gib=0.01,
        )  # fmt: skip
    print(cpu_flags())
    print(
        f"kernel={library.variant()} dtype={args.dtype} context={args.context} "
        f"threads={torch.get_num_threads()} ({args.clock} ms a step, medians of {args.rounds})"
    )
    cols = ("step", *SECTIONS, "rest")
    print("| batch | " + " | ".join(cols) + " |")
    print("| ---: |" + " ---: |" * len(cols))
    for batch in batches:
        seqs = decode_seqs(runner, batch, args.context)
        perf = perf_start(f"{args.perf}-{batch}.data") if args.perf else None
        rounds = [measure(runner, seqs, args.iters) for _ in range(args.rounds)]
        assert runner.model._cpu_decoder_plan is not None, "the one-call decoder did not run"
        med = {c: statistics.median(r[c] for r in rounds) for c in cols}
        print(f"| {batch} | " + " | ".join(f"{med[c]:.3f}" for c in cols) + " |")
        if perf is not None:
            perf_report(perf, f"{args.perf}-{batch}.data", med["step"], args.perf_min)


if __name__ == "__main__":
    main()
