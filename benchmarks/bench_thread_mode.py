#!/usr/bin/env python3
"""One step timed in the thread that loaded the kernel library and in a thread started before it.

A served executor runs its steps in gRPC threads that exist before the model (and the CPU kernel
library) is loaded; an offline run uses the thread that loaded it. The kernels set their own
floating-point mode now (csrc/simd.h, FlushMode): both threads should take the same time. Before,
the library's -ffast-math constructor had turned flush-to-zero on in the loading thread alone,
and the other threads took denormal assists in attention (docs/benchmarks.md, "The calling
thread's MXCSR").

The step: --prompts prompts of --prompt-len random tokens prefilled at once (the random
workload's admission step at 16 x 128), run in the two threads alternately, --rounds times.

    PYTHONPATH=. OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/bench_thread_mode.py \
        --model .cache/smollm-135m-random
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from pathlib import Path

# Started before torch and the kernel library are imported: its floating-point mode is the
# process's initial one, as a gRPC server thread's is.
_jobs: queue.Queue = queue.Queue()
_done: queue.Queue = queue.Queue()


def _early_worker() -> None:
    while True:
        _done.put(_jobs.get()())


threading.Thread(target=_early_worker, daemon=True).start()

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    runner = ModelRunner(
        Path(args.model), device="cpu", dtype="float32", num_device_blocks=4096,
        swap_space_gib=0.01, attention_backend="auto",
    )  # fmt: skip
    per = -(-args.prompt_len // runner.block_size)
    g = torch.Generator().manual_seed(0)
    seqs = [
        ScheduledSequence(
            f"p{i}",
            torch.randint(5, runner.info.vocab_size, (args.prompt_len,), generator=g).tolist(),
            args.prompt_len,
            list(range(i * per, (i + 1) * per)),
            0,
            args.prompt_len,
            SamplingParams(),
        )  # fmt: skip
        for i in range(args.prompts)
    ]

    def step() -> float:
        start = time.perf_counter()
        runner.execute(seqs, [], [], [])
        return time.perf_counter() - start

    step()  # warm-up
    loader, early = [], []
    for _ in range(args.rounds):  # alternated
        loader.append(step())
        _jobs.put(step)
        early.append(_done.get())
    n = args.prompts * args.prompt_len
    print(f"prefill step of {args.prompts} x {args.prompt_len} = {n} tokens, ms per round:")
    print("  loading thread:        " + " ".join(f"{t * 1e3:.0f}" for t in loader))
    print("  thread started before: " + " ".join(f"{t * 1e3:.0f}" for t in early))
    print(
        f"  ratio (median): {sorted(early)[len(early) // 2] / sorted(loader)[len(loader) // 2]:.3f}"
    )


if __name__ == "__main__":
    main()
