"""Many-core scaling of the CPU executor's parts, bf16, one process (issue 44).

For each thread count N of ``--threads``, every thread of this process (torch's pool, the
kernels' OpenMP pool, this one) is confined to the first N cores of ``--cores`` — what the
executor's ``--cpu-cores`` does — and torch (hence the kernels) runs N threads:

* ``gemm``: the bf16 GEMMs of one decode step of the SmolLM-135M-shaped model at ``--batch``
  rows, ours (``gemm_bf16``, packed) and oneDNN's (the reference bench_bf16.py uses);
* ``step``: the bf16 decode step (``ModelRunner.execute``, the one-call decoder), ``--batch``
  sequences with ``--context`` tokens each in the (zero) cache;
* ``attention``, ``layer-gemm``, ``sampler``, ``other``: the same step with the per-layer forward
  and profile_step.py's timers (so the step there is a little slower than ``step``).

One line per measurement (``scaling <what> threads=N ms=... x1=...``, x1 the speedup over the
first thread count), medians of ``--iters`` calls after a warm-up, the thread counts visited
``--rounds`` times in turn.

    taskset -c 0-15 python3 benchmarks/bench_scaling.py --threads 1,4,8,16 --cores 0-15
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_step  # noqa: E402
from bench_bf16 import HIDDEN, INTER, LAYERS, SHAPES, VOCAB  # noqa: E402
from bench_decode import SMOLLM_135M  # noqa: E402

from executor_svc.config.cpus import parse_cpu_list  # noqa: E402
from executor_svc.kernels import gemm_bf16, library  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402
from tests.support.model_factory import make_tiny_checkpoint  # noqa: E402


def pin(cores: list[int]) -> None:
    """Every thread there is now on ``cores``; threads started later inherit the set."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has exited since the listing
            os.sched_setaffinity(int(tid), cores)


def median_ms(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm-up: the pools at this size, caches
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def gemm_fns(batch: int) -> dict[str, Callable[[], None]]:
    """One decode step's matmuls: ours (packed bf16) and oneDNN's (blocked bf16)."""
    g = torch.Generator().manual_seed(0)
    mats = [(torch.randn(k, n, generator=g) * 0.05).bfloat16() for k, n in [*SHAPES]]
    mats.append((torch.randn(HIDDEN, VOCAB, generator=g) * 0.05).bfloat16())
    xs = {k: torch.randn(batch, k, generator=g).bfloat16() for k in (HIDDEN, INTER)}
    ins = [k for k, _ in SHAPES] + [HIDDEN]
    ours = [gemm_bf16.pack(w) for w in mats]
    reorder = torch.ops.mkldnn._reorder_linear_weight
    onednn = [reorder(w.t().contiguous(), None) for w in mats]

    def run(ws: list, call: Callable) -> Callable[[], None]:
        def step() -> None:
            for _ in range(LAYERS):
                for w, k in zip(ws[:4], ins[:4], strict=True):
                    call(w, xs[k])
            call(ws[4], xs[HIDDEN])

        return step

    linear = torch.ops.mkldnn._linear_pointwise
    return {
        "gemm-ours": run(ours, lambda w, x: w.linear(x, None)),
        "gemm-onednn": run(onednn, lambda w, x: linear(x, w, None, "none", [], "")),
    }


def step_fn(runner: ModelRunner, batch: int, context: int) -> Callable[[], object]:
    bs, seqs = runner.block_size, []
    per_seq = -(-(context + 1) // bs)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        tokens = torch.randint(3, SMOLLM_135M["vocab_size"], (context + 1,), generator=g).tolist()
        table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(ScheduledSequence(str(i), tokens, context, table, context, 1, SamplingParams()))
    return lambda: runner.execute(seqs, [], [], [])


def profiled(step: Callable[[], object], iters: int) -> dict[str, float]:
    """profile_step.py's families for ``iters`` steps (after one warm-up), ms per step."""
    step()
    profile_step.TIMES.clear()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    row = {k: v / iters * 1e3 for k, v in profile_step.TIMES.items()}
    row["step"] = (time.perf_counter() - t0) / iters * 1e3
    named = ("attention", "gemm", "logits", "sampler")
    row["other"] = row["step"] - sum(row.get(k, 0.0) for k in named)
    return {
        "attention": row.get("attention", 0.0),
        "layer-gemm": row.get("gemm", 0.0) + row.get("logits", 0.0),
        "sampler": row.get("sampler", 0.0),
        "other": row["other"],
        "layer-step": row["step"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,4,8,16")
    p.add_argument("--cores", default="", help="cores to use, in order (default: this process's)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--skip", default="", help="comma-separated: gemm, step, profile")
    args = p.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    cores = sorted(parse_cpu_list(args.cores)) if args.cores else sorted(os.sched_getaffinity(0))
    if max(threads) > len(cores):
        raise SystemExit(f"--threads {max(threads)} > {len(cores)} cores ({cores})")
    skip = set(args.skip.split(",")) - {""}
    print(f"scaling setup kernel={library.variant()} bf16_path={gemm_bf16.isa_path()} "
          f"cores={','.join(map(str, cores))} batch={args.batch} context={args.context}")  # fmt: skip
    results: dict[str, dict[int, list[float]]] = {}

    def sweep(fns: dict[str, Callable[[], object]]) -> None:
        for _ in range(args.rounds):
            for n in threads:
                pin(cores[:n])
                torch.set_num_threads(n)
                for name, fn in fns.items():
                    results.setdefault(name, {}).setdefault(n, []).append(median_ms(fn, args.iters))

    def sweep_profile(step: Callable[[], object]) -> None:
        for _ in range(args.rounds):
            for n in threads:
                pin(cores[:n])
                torch.set_num_threads(n)
                for name, ms in profiled(step, args.iters).items():
                    results.setdefault(name, {}).setdefault(n, []).append(ms)

    with torch.inference_mode():
        if "gemm" not in skip:
            sweep(gemm_fns(args.batch))
        if not {"step", "profile"} <= skip:
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = make_tiny_checkpoint(
                    Path(tmp) / "m", "llama", seed=0, tie_word_embeddings=True, **SMOLLM_135M
                )
                per_seq = -(-(args.context + 1) // 16)
                runner = ModelRunner(
                    model_dir, device="cpu", dtype="bfloat16", block_size=16,
                    num_device_blocks=args.batch * per_seq + 8, swap_space_gib=0.01,
                )  # fmt: skip
            step = step_fn(runner, args.batch, args.context)
            if "step" not in skip:
                sweep({"step": step})
            if "profile" not in skip:
                profile_step.instrument(runner)
                sweep_profile(step)
    for name, by_n in results.items():
        base = statistics.median(by_n[threads[0]])
        for n in threads:
            ms = statistics.median(by_n[n])
            print(f"scaling {name} batch={args.batch} threads={n} ms={ms:.2f} "
                  f"x{threads[0]}={base / ms:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
