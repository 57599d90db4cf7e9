"""Where a CUDA step's time goes: a Llama-3-8B-shaped bf16 model (random weights, no checkpoint)
in the model runner, decode steps at several batch sizes (CUDA graphs) and one 8192-token
prefill step, timed, then profiled with torch.profiler (top GPU kernels by total time).

    python benchmarks/profile_cuda_step.py --context 384 --batches 1,64,256,512,1024

"ms/step" syncs after every step (the host's preparation and the GPU's work one after the
other); "pipelined" launches ``--iters`` steps back to back with their draws left on the device
(``ModelRunner.launch(defer=True)``, what the overlapping executor does), so the host prepares
each step while the GPU runs the one before: the GPU-bound step time. The floor is the weights
read once at the card's memory bandwidth (H200 4.8 TB/s, H100 3.35 TB/s, ``--bandwidth``).

Prints the table and the profiles; docs/benchmarks.md ("CUDA") records a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.demo.demo_model import build_demo_model  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402

LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
BLOCK = 16


def decode_seqs(batch: int, context: int, vocab: int) -> list[ScheduledSequence]:
    per = -(-(context + 1) // BLOCK)
    g = torch.Generator().manual_seed(batch)
    out = []
    for i in range(batch):
        toks = torch.randint(3, vocab, (context + 1,), generator=g).tolist()
        table = list(range(i * per, (i + 1) * per))
        out.append(ScheduledSequence(str(i), toks, context, table, context, 1, SamplingParams()))
    return out


def prefill_seqs(num: int, length: int, vocab: int) -> list[ScheduledSequence]:
    per = -(-length // BLOCK)
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(num):
        toks = torch.randint(3, vocab, (length,), generator=g).tolist()
        table = list(range(i * per, (i + 1) * per))
        out.append(ScheduledSequence(f"p{i}", toks, length, table, 0, length, SamplingParams()))
    return out


def timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pipelined(runner: ModelRunner, seqs: list[ScheduledSequence], iters: int) -> float:
    """Seconds per step of ``iters`` steps launched back to back (draws left on the device)."""
    runner.launch(seqs, [], [], [], defer=True).results()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        last = runner.launch(seqs, [], [], [], defer=True)
    last.results()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def profile(fn, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"\n### profile: {label}\n")
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--batches", default="1,64,256,512,1024")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profile-batch", type=int, default=512)
    p.add_argument("--rows", type=int, default=14)
    p.add_argument("--no-profile", action="store_true", help="timings only")
    p.add_argument("--bandwidth", type=float, default=0.0, help="TB/s (default: by card name)")
    args = p.parse_args()
    os.environ["LLMSERVE_LOAD_FORMAT"] = "dummy"
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(max(batches) * -(-(args.context + 1) // BLOCK), 32 * 16 + 1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_demo_model(Path(tmp) / "l3-8b", weights=False, **LLAMA3_8B)
        runner = ModelRunner(
            model_dir, device="cuda", dtype="bfloat16", block_size=BLOCK,
            num_device_blocks=blocks, swap_space_gib=0.01,
        )  # fmt: skip
    vocab = runner.info.vocab_size
    weight_bytes = sum(t.numel() * t.element_size() for t in runner.model.parameters())
    print(f"{torch.cuda.get_device_name()}; weights {weight_bytes / 1e9:.1f} GB bf16; "
          f"context {args.context}; graphs up to {runner.graphs.max_batch if runner.graphs else 0}")  # fmt: skip
    name = torch.cuda.get_device_name()
    tbps = args.bandwidth or (4.8 if "H200" in name else 3.35)
    floor = weight_bytes / (tbps * 1e12)
    print(f"\n| batch | ms/step | pipelined ms/step | tok/s pipelined | pipelined ÷ floor "
          f"({floor * 1e3:.2f} ms at {tbps} TB/s) |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: |")
    steps = {}
    for b in batches:
        seqs = decode_seqs(b, args.context, vocab)
        steps[b] = lambda seqs=seqs: runner.execute(seqs, [], [], [])
        steps[b]()
        t = timed(steps[b], args.iters)
        tp = pipelined(runner, seqs, args.iters)
        print(f"| {b} | {t * 1e3:.2f} | {tp * 1e3:.2f} | {b / tp:.0f} | {tp / floor:.2f} |")
    pre = prefill_seqs(32, 256, vocab)
    prefill = lambda: runner.execute(pre, [], [], [])  # noqa: E731
    prefill()
    t = timed(prefill, 3)
    flops = 2 * weight_bytes / 2 * 32 * 256
    print(f"\nprefill 32 x 256 = 8192 tokens: {t * 1e3:.1f} ms ({flops / t / 1e12:.0f} TFLOP/s "
          "counting 2 x params per token, attention excluded)")  # fmt: skip
    if args.no_profile:
        return
    if args.profile_batch in steps:
        profile(steps[args.profile_batch], f"decode batch {args.profile_batch}", args.rows)
    profile(prefill, "prefill 8192 tokens", args.rows)


if __name__ == "__main__":
    main()
