#!/usr/bin/env python3
"""Where an executor step goes, by op family, and how busy the executor is when serving.

Part 1 (in-process, the SmolLM-135M-shaped random Llama, fp32, one torch thread): decode steps
at batch 1, 16 and 64 (``--context`` tokens each already in the cache) and one 2 048-token
prefill, each run through ``ModelRunner.execute``. Timers wrap the code of each family, so a
step's wall time splits into: prepare (``prepare_inputs``), GEMMs (every ``Linear``), attention
(the backend's ``attend``: K/V write + paged attention; the K/V write alone also shown; on
the cpu backend rope, K/V write and attention are one kernel call, all counted here), norms,
rope (when separate), logits (the lm_head on sampled rows), sampler, cache ops (swap/copy lists; none here) and
other (embedding, activation, residual adds, Python between ops).

Part 2 (``--live``): the whole stack (Redis, executor with one thread, scheduler) serves the
random 64 x 128 -> 128 workload; the executor's ``step.done`` log gives each step's busy time
and end, so the gaps between steps are the executor's idle time (waiting for the scheduler's
next ``ExecuteModel``). Reported for steady decode at the full batch.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/profile_step.py [--live]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from executor_svc.attention import AttentionBackend  # noqa: E402
from executor_svc.models import llama  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402

FAMILIES = ("prepare", "gemm", "attention", "kv_write", "norm", "rope", "logits", "sampler")
TIMES: dict[str, float] = defaultdict(float)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - start

    return wrapper


def instrument(runner: ModelRunner) -> None:
    """Wrap each family's entry point (classes and module functions, so every layer counts).
    The timers need the per-layer forward, so the one-call CPU decoder (models/cpu_decoder.py)
    is turned off: on a CPU the step measured here includes the Python between kernels that it
    saves."""
    runner.model._cpu_decoder_plan = None  # "not taken": the per-layer forward
    ModelRunner.prepare_inputs = _timed("prepare", ModelRunner.prepare_inputs)
    ModelRunner._sample = _timed("sampler", ModelRunner._sample)
    llama.Linear.forward = _timed("gemm", llama.Linear.forward)
    llama.RMSNorm.forward = _timed("norm", llama.RMSNorm.forward)
    llama.RotaryEmbedding.apply = staticmethod(_timed("rope", llama.RotaryEmbedding.apply))
    llama.LlamaForCausalLM.compute_logits = _timed("logits", llama.LlamaForCausalLM.compute_logits)
    AttentionBackend.attend = _timed("attention", AttentionBackend.attend)
    if runner.backend.attend_rope_fn is not None:  # rope + K/V write + attention in one call
        fused = _timed("attention", runner.backend.attend_rope_fn)
        object.__setattr__(runner.backend, "attend_rope_fn", fused)  # a frozen dataclass
    ops = sys.modules[runner.backend.write_kv.__module__]
    if hasattr(ops, "_write_kv"):  # what attend() calls: patched in its module
        ops._write_kv = _timed("kv_write", ops._write_kv)


def make_runner(model_dir: Path, backend: str, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(
        model_dir, device="cpu", num_device_blocks=4096, swap_space_gib=0.01,
        attention_backend=backend, dtype=dtype,
    )  # fmt: skip


def decode_batch(runner: ModelRunner, batch: int, context: int) -> list[ScheduledSequence]:
    """`batch` sequences with `context` tokens each, prefilled, ready to decode one token."""
    bs, params, seqs = runner.block_size, SamplingParams(), []
    per_seq = -(-(context + 2) // bs)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        tokens = torch.randint(5, runner.info.vocab_size, (context,), generator=g).tolist()
        table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(ScheduledSequence(f"s{i}", tokens, context, table, 0, context, params))
    for start in range(0, batch, 8):  # prefill 8 at a time
        runner.execute(seqs[start : start + 8], [], [], [])
    return [
        ScheduledSequence(s.seq_id, [*s.token_ids, 7], context, s.block_table, context, 1, params)
        for s in seqs
    ]


def profile(runner: ModelRunner, seqs: list[ScheduledSequence], iters: int) -> dict[str, float]:
    for _ in range(2):
        runner.execute(seqs, [], [], [])
    TIMES.clear()
    cache0 = runner.phase_seconds["cache_ops"]
    start = time.perf_counter()
    for _ in range(iters):
        runner.execute(seqs, [], [], [])
    total = time.perf_counter() - start
    row = {k: TIMES[k] / iters * 1e3 for k in FAMILIES}
    row["cache_ops"] = (runner.phase_seconds["cache_ops"] - cache0) / iters * 1e3
    row["step"] = total / iters * 1e3
    accounted = sum(row[k] for k in FAMILIES if k != "kv_write") + row["cache_ops"]
    row["other"] = row["step"] - accounted
    return row


def print_table(rows: dict[str, dict[str, float]]) -> None:
    cols = ["step", *FAMILIES, "cache_ops", "other"]
    print("| case | " + " | ".join(f"{c} ms" for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in rows.items():
        cells = [f"{row[c]:.2f} ({row[c] / row['step']:.0%})" if c != "step" else f"{row[c]:.2f}"
                 for c in cols]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")


def synthetic(
    model_dir: Path, backend: str, context: int, iters: int, dtype: str = "float32",
    batches: tuple[int, ...] = (1, 16, 64), prefill: bool = True, fused: bool = False,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    runner = make_runner(model_dir, backend, dtype)
    if not fused:
        instrument(runner)
    rows = {}
    for batch in batches:
        seqs = decode_batch(runner, batch, context)
        rows[f"decode x{batch} @ {context}"] = profile(runner, seqs, iters)
    if not prefill:
        print(f"backend={runner.backend.name}, dtype={dtype}, threads={torch.get_num_threads()}")
        print_table(rows)
        return
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, runner.info.vocab_size, (2048,), generator=g).tolist()
    prefill = [ScheduledSequence("p", tokens, 2048, list(range(3000, 3129)), 0, 2048,
                                 SamplingParams())]  # fmt: skip
    rows["prefill 2048"] = profile(runner, prefill, max(iters // 5, 1))
    print(f"backend={runner.backend.name}, torch threads={torch.get_num_threads()}")
    print_table(rows)


LIVE_WORKLOADS = {
    "random": ["--workload", "random", "--num-prompts", "64", "--input-len", "128",
               "--output-len", "128"],
    "prefix": ["--workload", "shared-prefix", "--num-prompts", "64", "--prefix-len", "1024",
               "--question-len", "32", "--output-len", "32"],
    "sharegpt": ["--workload", "sharegpt-like", "--num-prompts", "200"],
    "b1": ["--workload", "random", "--num-prompts", "1", "--input-len", "512",
           "--output-len", "129"],
}  # fmt: skip


def live(
    model_dir: Path,
    executor_args: list[str],
    workload: str = "random",
    scheduler_args: list[str] = (),  # type: ignore[assignment]
) -> None:
    import subprocess
    import tempfile

    import bench_vs_hf
    from step_log_stats import busy_fraction, summary

    work = Path(tempfile.mkdtemp(prefix="profile-live-"))
    bench_vs_hf.EXECUTOR_EXTRA = ["--cpu-threads", "1", *executor_args]
    log_path = work / "executor.log"
    stack = bench_vs_hf.Stack(model_dir, work, 64, 4096)
    stack.redis.start()
    with open(log_path, "w") as log:
        bench_vs_hf.EXECUTOR_EXTRA += ["--log-level", "debug"]
        real_popen = subprocess.Popen
        subprocess.Popen = lambda *a, **k: real_popen(*a, **{**k, "stderr": log})  # type: ignore
        try:
            stack.start_executor()
        finally:
            subprocess.Popen = real_popen  # type: ignore
        try:
            address = stack.start_scheduler(*scheduler_args)
            bench_vs_hf.run_bench(
                ["--backend", "llmserve", "--address", address, *LIVE_WORKLOADS[workload],
                 "--no-progress"],
                work / f"{workload}.json",
            )  # fmt: skip
        finally:
            stack.close()
    print(summary(log_path))
    print(busy_fraction(log_path, num_seqs=1 if workload == "b1" else 64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="auto", help="attention backend")
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--dtype", default="float32", help="the model's dtype (float32, bfloat16)")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    p.add_argument("--no-prefill", action="store_true", help="skip the 2048-token prefill")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--fused",
        action="store_true",
        help="no timers, so the one-call CPU decoder runs where it takes the model: only the"
        " step column counts",
    )
    p.add_argument("--live", action="store_true", help="also the served run's idle time")
    p.add_argument("--executor-args", default="", help="extra executor flags for --live")
    p.add_argument("--scheduler-args", default="", help="extra scheduler flags for --live")
    p.add_argument(
        "--workload", choices=sorted(LIVE_WORKLOADS), default="random", help="what --live serves"
    )
    p.add_argument("--live-only", action="store_true", help="skip the in-process cases")
    args = p.parse_args()
    from bench_vs_hf import build_model

    model_dir = build_model(ROOT / ".cache")
    if not args.live_only:
        batches = tuple(int(b) for b in args.batches.split(","))
        synthetic(model_dir, args.backend, args.context, args.iters, args.dtype, batches,
                  not args.no_prefill, args.fused)  # fmt: skip
    if args.live or args.live_only:
        live(model_dir, args.executor_args.split(), args.workload, args.scheduler_args.split())


if __name__ == "__main__":
    main()
