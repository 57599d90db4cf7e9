"""Decode step time: ModelRunner vs Hugging Face transformers, and the memory roofline.

Model: SmolLM-135M-shaped random Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate
1536, vocab 49152, tied embeddings), fp32, on the CPU (or CUDA with --device cuda). Every sequence
has CONTEXT tokens in its KV cache and decodes one more. The KV contents are random: the cost of a
decode step does not depend on them, and prefilling 64 x 128 tokens would dominate the run.

* ours: ``ModelRunner.execute`` (input preparation, forward, logits, greedy sampling).
* hf:   ``LlamaForCausalLM(input_ids[B, 1], past_key_values=DynamicCache)`` + argmax; the cache
        is cropped back after each step so every step sees the same context.
* roofline: weight bytes / copy bandwidth of ``dst.copy_(src)`` on 1 GiB tensors. At batch 1 a
  decode step must read every weight once, so this bounds the step time from below. Two
  conventions are shown: "copy" = bytes copied / time (1 GiB / t), and "stream" = bytes read +
  written / time (2 GiB / t, as STREAM counts it, close to a pure read's bandwidth).

Both engines run in the same process, alternating, ``--repeats`` times; the table shows medians,
so the load other processes put on the machine hits both alike.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_decode.py --threads 1 \
        --write docs/bench-notes/decode.md
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

from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402
from tests.support.model_factory import load_hf_model, make_tiny_checkpoint  # noqa: E402

SMOLLM_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rope_theta": 10000.0,
}
CONTEXT = 128
BLOCK_SIZE = 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes copied per second (1 GiB / time), best of ``repeats``."""
    src = torch.ones(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best


def time_it(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``iters`` calls."""
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours_step(runner: ModelRunner, batch: int):
    seqs = []
    blocks_per_seq = -(-(CONTEXT + 1) // BLOCK_SIZE)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        tokens = torch.randint(3, SMOLLM_135M["vocab_size"], (CONTEXT + 1,), generator=g).tolist()
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(ScheduledSequence(str(i), tokens, CONTEXT, table, CONTEXT, 1, SamplingParams()))
    return lambda: runner.execute(seqs, [], [], [])


def hf_step(model, batch: int, device: torch.device):
    from transformers import DynamicCache

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, CONTEXT, head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, device=device), torch.randn(shape, device=device), layer)
    input_ids = torch.randint(3, cfg.vocab_size, (batch, 1), device=device)
    position_ids = torch.full((batch, 1), CONTEXT, device=device)

    def step():
        with torch.inference_mode():
            out = model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache)
            out.logits[:, -1].argmax(-1)
        cache.crop(-1)  # drop the token just appended

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--write", type=Path, help="markdown file for the results")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(
            Path(tmp) / "smollm-135m-random", "llama", tie_word_embeddings=True, **SMOLLM_135M
        )
        blocks = max(batches) * -(-(CONTEXT + 1) // BLOCK_SIZE)
        runner = ModelRunner(
            model_dir,
            device=str(device),
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_device_blocks=blocks,
            swap_space_gib=0.01,
        )
        hf = load_hf_model(model_dir).to(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    bandwidth = copy_bandwidth(device)
    roofline = weight_bytes / bandwidth  # "copy" convention
    roofline_stream = roofline / 2

    steps = {b: (ours_step(runner, b), hf_step(hf, b, device)) for b in batches}
    for ours, ref in steps.values():  # warm-up: first heavy runs are ~10x slow
        for _ in range(2):
            ours()
            ref()
    results: dict[int, tuple[list[float], list[float]]] = {b: ([], []) for b in batches}
    for _ in range(args.repeats):
        for b, (ours, ref) in steps.items():
            results[b][0].append(time_it(ours, device, args.iters))
            results[b][1].append(time_it(ref, device, args.iters))

    lines = [
        f"device: {device} ({torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs), "
        f"torch {torch.__version__}",
        f"weights: {weight_bytes / 1e6:.1f} MB fp32; copy bandwidth {bandwidth / 1e9:.2f} GB/s "
        f"copied ({2 * bandwidth / 1e9:.2f} GB/s read+written); roofline at batch 1: "
        f"{roofline * 1e3:.1f} ms/step (copy), {roofline_stream * 1e3:.1f} ms/step (stream)",
        "",
        "| batch | ours ms/step | HF ms/step | HF / ours | ours tok/s "
        "| roofline (copy) / ours | roofline (stream) / ours |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b in batches:
        ours_t = statistics.median(results[b][0])
        hf_t = statistics.median(results[b][1])
        lines.append(
            f"| {b} | {ours_t * 1e3:.1f} | {hf_t * 1e3:.1f} | {hf_t / ours_t:.2f} "
            f"| {b / ours_t:.0f} | {roofline / ours_t:.0%} | {roofline_stream / ours_t:.0%} |"
        )
    lines.append("")
    lines.append(
        "per-round medians (ms), ours / HF: "
        + "; ".join(
            f"b{b}: "
            + ", ".join(f"{o * 1e3:.0f}/{h * 1e3:.0f}" for o, h in zip(*results[b], strict=True))
            for b in batches
        )
    )
    text = "\n".join(lines)
    print(text)
    if args.write:
        cmd = "HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_decode.py " + " ".join(
            sys.argv[1:]
        )
        args.write.parent.mkdir(parents=True, exist_ok=True)
        header = (
            "# Decode step benchmark\n\n"
            "SmolLM-135M-shaped random Llama, fp32, context "
            f"{CONTEXT} tokens per sequence, one decode step per sequence. Sections are appended "
            "by each run of `--write`.\n"
        )
        old = args.write.read_text() if args.write.exists() else header
        section = f"\n## {torch.get_num_threads()} thread(s)\n\nCommand:\n\n    {cmd}\n\n{text}\n"
        args.write.write_text(old + section)


if __name__ == "__main__":
    main()
