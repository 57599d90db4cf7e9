#!/usr/bin/env python3
"""A whole offline workload in one process, and where its time goes by op family.

The scheduler core and the executor's runner in one process (tests/support/spec_driver.py: no
gRPC, no Redis), greedy, one torch thread, prefix caching on; profile_step.py's family timers
over the whole run (matmuls, attention, lm_head, ...). Workloads:

* shared-prefix: 64 prompts of 1 024 shared + 32 own random tokens, 32 tokens out each (the
  shape of bench_vs_vllm.py's shared-prefix workload);
* serve32: 32 prompts of 60 random tokens, 32 tokens out each (the batch of the 32-stream
  serving comparison against llama.cpp).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python \\
        benchmarks/profile_workload.py --workload shared-prefix --dtype float32
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python \\
        benchmarks/profile_workload.py --workload serve32 --model FILE.gguf --rounds 2

Without ``--model`` the real SmolLM2-135M-Instruct (tests/support/smollm2.py) is used.
``--time cpu`` reports thread CPU time instead of wall time.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_step  # noqa: E402

from executor_svc.api.server import resolve_model  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner  # noqa: E402
from scheduler_svc.core.sampling_params import SamplingParams  # noqa: E402
from tests.support.spec_driver import run_requests  # noqa: E402

BLOCKS = 8192


def workload(name: str, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    hi = min(vocab, 40000)
    if name == "shared-prefix":
        shared = [rng.randrange(100, hi) for _ in range(1024)]
        return [(shared + [rng.randrange(100, hi) for _ in range(32)], params) for _ in range(64)]
    return [([rng.randrange(100, hi) for _ in range(60)], params) for _ in range(32)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["shared-prefix", "serve32"], default="shared-prefix")
    p.add_argument("--model", default=None, help="any --model the executor takes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--time", choices=["wall", "cpu"], default="wall")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.time == "cpu":
        profile_step.time = types.SimpleNamespace(perf_counter=time.thread_time)  # type: ignore
    clock = time.thread_time if args.time == "cpu" else time.perf_counter
    if args.model is None:
        from tests.support.smollm2 import ensure_smollm2

        model_dir = ensure_smollm2()
    else:
        model_dir, _ = resolve_model(args.model)
    runner = ModelRunner(
        model_dir, device="cpu", dtype=args.dtype, num_device_blocks=BLOCKS, swap_space_gib=0.01
    )
    profile_step.instrument(runner)
    reqs = workload(args.workload, runner.info.vocab_size)
    print(f"{args.workload}, {model_dir.name}, {runner.info.dtype_name}, {args.time} time (s)")
    print("| round | total | decode steps | " + " | ".join(profile_step.FAMILIES) + " |")
    print("|---" * (3 + len(profile_step.FAMILIES)) + "|")
    for r in range(args.rounds):
        profile_step.TIMES.clear()
        t0 = clock()
        run = run_requests(
            runner, reqs, None, num_device_blocks=BLOCKS, max_num_batched_tokens=2048,
            max_num_seqs=64, check=False,
        )  # fmt: skip
        total = clock() - t0
        decode = run.decode_cpu_s if args.time == "cpu" else run.decode_s
        fam = " | ".join(f"{profile_step.TIMES[k]:.2f}" for k in profile_step.FAMILIES)
        print(f"| {r} | {total:.2f} | {decode:.2f} | {fam} |", flush=True)


if __name__ == "__main__":
    main()
