"""Perplexity-style drift of ``--quantization int8 | int4`` against fp32 on a fixed text, and
batch-1 decode speed of each, on an HF checkpoint directory (ModelRunner in this process).

For each mode: the log-probability of every token of ``TEXT`` given the ones before it (one
prefill with prompt logprobs), its perplexity, the mean and max |logprob - fp32's| and the
fraction of positions whose fp32 argmax stays the argmax; then the decode time per token of 64
greedy tokens after it, one thread, and how many of those greedy tokens equal fp32's before the
first difference. ``--gguf FILE`` (the GGUF the directory was de-quantized from) adds the GGUF
run as-is and with ``LLMSERVE_QUANT_ACT=int8`` (activations quantized to int8 per group), and
``--quantization int8`` with int8 activations; ``--hf`` transformers' own fp32 run of the
directory (its decode time is ``generate``'s, not comparable).

    taskset -c 0 .venv/bin/python benchmarks/quant_drift.py \\
        ~/.cache/llmserve/smollm2-135m-instruct/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined a screw press, oil-based ink and movable metal type into a system that could "
    "produce books far faster than any scribe. Within fifty years, presses operated in more than "
    "two hundred European cities, and millions of volumes had been printed. The consequences "
    "reached well beyond the book trade: scientific results could be copied exactly and shared, "
    "vernacular languages gained standard spellings, and ideas that once travelled by letter now "
    "moved through pamphlets read by thousands. Historians still debate how much of the "
    "Reformation, the scientific revolution and the rise of newspapers owes to this one machine, "
    "but few doubt that the cheap, identical copy changed how knowledge was kept and argued over."
)
BLOCK = 16


def run(
    model_dir: str,
    quantization: str | None,
    decode_tokens: int,
    repeats: int,
    model: str | None = None,
    quant_act: str = "fp32",
):
    """(prompt logprobs, their top-1 tokens, decode ms/token, the greedy tokens) of ``model``
    (default ``model_dir``; the tokenizer is ``model_dir``'s)."""
    from transformers import AutoTokenizer

    from executor_svc.api.server import resolve_model

    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT).input_ids
    blocks = -(-(len(ids) + decode_tokens + 1) // BLOCK)
    os.environ["LLMSERVE_QUANT_ACT"] = quant_act  # read as the quantized weights load
    runner = ModelRunner(  # float32: dtype auto is bf16 on a CPU with AVX512-BF16 or AMX
        resolve_model(model)[0] if model else model_dir,
        num_device_blocks=blocks + 1,
        swap_space_gib=0.01,
        quantization=quantization,
        dtype="float32",
    )
    os.environ.pop("LLMSERVE_QUANT_ACT")
    params = SamplingParams(temperature=0.0, num_prompt_logprobs=1)
    seq = ScheduledSequence("s", list(ids), len(ids), list(range(blocks)), 0, len(ids), params)
    found: list = []
    out = runner.execute([seq], [], [], [], prompt_logprobs=found)
    logprobs = [lp for r in found for lp in r.logprobs]
    top1 = [t[0][0] for r in found for t in r.top]
    times = []
    for _ in range(repeats):
        seq.token_ids = list(ids) + [out[0].token_id]
        seq.num_computed_tokens, seq.num_scheduled_tokens = len(ids), 1
        seq.sampling_params = SamplingParams(temperature=0.0)
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            res = runner.execute([seq], [], [], [])
            seq.token_ids.append(res[0].token_id)
            seq.num_computed_tokens += 1
        times.append((time.perf_counter() - t0) * 1000 / decode_tokens)
    return logprobs, top1, statistics.median(times), seq.token_ids[len(ids) :]


def run_hf(model_dir: str, decode_tokens: int):
    """``run``'s numbers from transformers itself (fp32, the reference the GGUF tests use)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()
        top1 = logits.argmax(-1).tolist()
        t0 = time.perf_counter()
        out = model.generate(
            ids, do_sample=False, max_new_tokens=decode_tokens + 1,
            min_new_tokens=decode_tokens + 1, pad_token_id=0,
        )  # fmt: skip
        ms = (time.perf_counter() - t0) * 1000 / (decode_tokens + 1)
    return logprobs, top1, ms, out[0, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf", default=None, help="the GGUF file model_dir came from")
    parser.add_argument("--hf", action="store_true", help="also transformers' own fp32 forward")
    args = parser.parse_args()
    torch.set_num_threads(1)
    d, n, r = args.model_dir, args.decode_tokens, args.repeats
    modes = {"fp32": lambda: run(d, None, n, r), "int8": lambda: run(d, "int8", n, r),
             "int4": lambda: run(d, "int4", n, r)}  # fmt: skip
    if args.gguf:
        modes["int8, int8 act"] = lambda: run(d, "int8", n, r, quant_act="int8")
        modes["gguf"] = lambda: run(d, None, n, r, model=args.gguf)
        modes["gguf, int8 act"] = lambda: run(d, None, n, r, model=args.gguf, quant_act="int8")
    if args.hf:
        modes["hf transformers"] = lambda: run_hf(d, n)
    results = {name: fn() for name, fn in modes.items()}
    ref_lp, ref_top, ref_ms, ref_out = results["fp32"]
    print(f"{len(ref_lp)} scored tokens; decode: {args.decode_tokens} tokens, 1 thread")
    print("| mode | perplexity | mean abs dlogprob | max abs dlogprob | top-1 kept | "
          "greedy tokens = fp32's | decode ms/token | speed vs fp32 |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, (lp, top, ms, out) in results.items():
        ppl = math.exp(-sum(lp) / len(lp))
        diffs = [abs(a - b) for a, b in zip(lp, ref_lp, strict=True)]
        kept = sum(a == b for a, b in zip(top, ref_top, strict=True)) / len(top)
        same = next(
            (i for i, (a, b) in enumerate(zip(out, ref_out, strict=True)) if a != b), len(out)
        )
        print(f"| {mode} | {ppl:.3f} | {statistics.mean(diffs):.4f} | {max(diffs):.4f} "
              f"| {kept:.3f} | {same}/{len(out)} | {ms:.2f} | {ref_ms / ms:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
