"""Speculative decoding (n-gram prompt lookup, or a draft model) on the real SmolLM2-135M-Instruct:
ms per output token at batch 1, with and without, and the throughput curve over concurrent
streams.

`--method draft_model --draft-layers N`: the draft is SmolLM2 cut to its first N layers (same
embeddings, final norm and LM head; tests/support/draft_models.py), written to a temporary
directory and loaded by the runner (`speculative_model`); its catch-up over the prompt runs in
the first speculating step, which counts as a decode step here.

What runs: the scheduler core and the executor servicer in one process
(tests/support/spec_driver.py: step message, validation, runner, sampler, acceptance, the
block manager; no gRPC, no Redis), greedy, one torch thread by default. Each configuration is
run alternately, off then on, `--repeats` times; medians are shown, so load from other processes
hits both alike. Outputs of "on" are checked equal to "off" in every run.

Workloads:
* grounded: a ~500-token passage with an instruction that makes the answer reuse it (quote it,
  edit it, summarise it), chat template applied; up to --max-tokens output tokens.
* random: random token ids of the same length (n-gram proposals rarely match).

cpu_* is the same with the process's CPU time instead of wall time: on a machine shared with other
work (whose load moves the wall time by several times within minutes) it is the steadier figure.
ms/token (per stream) is the wall time of the steps in which every sequence decodes (prefill
steps left out: speculation does not touch them) times the streams, over the output tokens those
steps produced; tokens/s is those tokens over that time, all streams together.

    HF_HUB_OFFLINE=1 taskset -c 1 .venv/bin/python benchmarks/bench_spec_decode.py --threads 1
    HF_HUB_OFFLINE=1 taskset -c 1 .venv/bin/python benchmarks/bench_spec_decode.py --threads 1 \
        --method draft_model --draft-layers 4 --workloads grounded
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.config.logs import configure_logging  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner  # noqa: E402
from scheduler_svc.core.sampling_params import SamplingParams  # noqa: E402
from scheduler_svc.features.spec.decode import SpeculativeConfig  # noqa: E402
from tests.support.draft_models import truncate_checkpoint  # noqa: E402
from tests.support.smollm2 import ensure_smollm2  # noqa: E402
from tests.support.spec_driver import run_requests  # noqa: E402

PASSAGE = (
    "The lighthouse at Kerrow Point was built in 1871 from granite quarried on the island "
    "itself. For ninety years three keepers lived in the cottages beside it, taking turns to "
    "watch the lamp through the night, wind the clockwork that turned the lens, and record the "
    "weather every four hours in a leather-bound log. The lens, made in Paris, weighed nearly "
    "four tonnes and floated on a bath of mercury so that a single keeper could turn it by hand "
    "if the clockwork failed. In the winter of 1894 a storm tore the roof from the oil store and "
    "the keepers kept the light burning for six days with paraffin carried up the tower in "
    "buckets. Supply boats came from the mainland once a fortnight when the sea allowed, "
    "bringing flour, coal, letters and newspapers that were often a month old by the time they "
    "were read. The children of the keepers were taught at a small school on the mainland and "
    "crossed the sound on Monday mornings, returning on Friday afternoons if the weather was "
    "calm. In 1962 the light was converted to electricity and the keepers were reduced to two. "
    "Automation followed in 1988, and the last keeper, a man named Alasdair Munro, locked the "
    "door of the tower for the final time on the first of April that year. Today the cottages "
    "are a small museum run by volunteers, who show visitors the log books, the brass fittings "
    "of the old lamp and the narrow beds where the keepers slept between watches. The light "
    "itself still flashes white twice every fifteen seconds and can be seen from twenty-two "
    "nautical miles away on a clear night. Seabirds nest on the cliffs below the tower from "
    "April to August, and the island is now a nature reserve where puffins, razorbills and "
    "guillemots can be watched from a hide built into the old boat shed. Grey seals haul out "
    "on the rocks at the north end of the island in autumn, and in a good year more than forty "
    "pups are born there. The volunteers count them every October and send the figures to the "
    "marine research station at Oban, which has kept records since 1975. A ferry now runs from "
    "the mainland three times a week between May and September, and the crossing takes about "
    "forty minutes when the tide is favourable."
)
TASKS = [
    "Repeat the following passage word for word.",
    "Rewrite the following passage, changing every date to the year 2000 and keeping "
    "everything else the same.",
    "Quote the sentences of the following passage that mention the keepers.",
    "Summarise the following passage, quoting its key facts.",
]


def grounded_prompts(tokenizer, n: int, start: int = 0) -> list[list[int]]:
    out = []
    for i in range(start, start + n):
        msg = f"{TASKS[i % len(TASKS)]}\n\n{PASSAGE}"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def timed(runner, prompts, max_tokens, spec, eos):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    run = run_requests(
        runner,
        [(p, params) for p in prompts],
        spec,
        eos_token_ids=eos,
        num_device_blocks=runner.num_device_blocks,
        max_num_batched_tokens=4096,
        max_num_seqs=64,
        check=False,
    )
    return time.perf_counter() - t0, run


def compare(runner, prompts, args, eos, spec) -> dict:
    """Alternate off/on; returns medians and the acceptance of 'on'."""
    res: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    acc = [0, 0]
    num_out = 0
    for _ in range(args.repeats):
        for name, cfg in (("off", None), ("on", spec)):
            _, run = timed(runner, prompts, args.max_tokens, cfg, eos)
            if name == "off":
                ref, num_out = run.outputs, sum(len(o[0]) for o in run.outputs.values())
            else:
                assert run.outputs == ref, "speculation changed an output"
                acc[0] += run.accepted
                acc[1] += run.proposed
            res[name].append(run.decode_s / max(run.decode_tokens, 1))
            cpu[name].append(run.decode_cpu_s / max(run.decode_tokens, 1))
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    n = len(prompts)
    return {
        "cpu_ms_per_token_off": round(cpu_off * 1e3 * n, 3),
        "cpu_ms_per_token_on": round(cpu_on * 1e3 * n, 3),
        "cpu_speedup": round(cpu_off / cpu_on, 3),
        "ms_per_token_off": round(off * 1e3 * n, 3),  # per stream
        "ms_per_token_on": round(on * 1e3 * n, 3),
        "tok_s_off": round(1 / off, 1),
        "tok_s_on": round(1 / on, 1),
        "speedup": round(off / on, 3),
        "acceptance": round(acc[0] / acc[1], 3) if acc[1] else 0.0,
        "output_tokens": num_out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--streams", default="1", help="comma-separated concurrency levels")
    ap.add_argument(
        "--workloads",
        default="grounded,random",
        help="grounded, random, grounded-each (batch 1: every task's prompt in turn, and all)",
    )
    ap.add_argument("--dtype", default="float32", help="the model's (auto: bf16 on AVX512-BF16)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    ap.add_argument("--draft-layers", type=int, default=4, help="draft_model: SmolLM2's first N")
    ap.add_argument(
        "--model",
        default=None,
        help="the target instead of SmolLM2's fp32 directory: another checkpoint directory or the "
        "package's Q4_1 .gguf (served quantized); the tokenizer still comes from SmolLM2's "
        "directory, so it needs SmolLM2's vocabulary",
    )
    args = ap.parse_args()
    if args.model and args.method == "draft_model":
        ap.error("--model is for the n-gram method (the draft is cut from SmolLM2's directory)")
    torch.set_num_threads(args.threads)
    configure_logging("warning")
    from transformers import AutoTokenizer

    model_dir = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory(prefix="llmserve-draft-") as tmp:
        run_all(args, model_dir, tok, Path(tmp))


def run_all(args: argparse.Namespace, model_dir: Path, tok, tmp: Path) -> None:
    if args.method == "draft_model":
        draft = truncate_checkpoint(
            model_dir, tmp / f"draft-{args.draft_layers}", args.draft_layers
        )
        runner = ModelRunner(
            model_dir,
            block_size=16,
            num_device_blocks=64 * 48,
            speculative_model=draft,
            dtype=args.dtype,
        )
        spec = SpeculativeConfig(
            method="draft_model", model=str(draft), num_speculative_tokens=args.k
        )
    else:
        target = Path(args.model) if args.model else model_dir
        if target.suffix == ".gguf":
            from executor_svc.features.gguf.hf_files import prepare

            target = prepare(target)
        runner = ModelRunner(target, block_size=16, num_device_blocks=64 * 48, dtype=args.dtype)
        spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=4)
    eos = tuple(runner.info.eos_token_ids)
    length = len(grounded_prompts(tok, 1)[0])
    for workload in args.workloads.split(","):
        if workload == "grounded-each":
            each_task(runner, tok, args, eos, spec, length)
            continue
        for streams in (int(s) for s in args.streams.split(",")):
            if workload == "grounded":
                prompts = grounded_prompts(tok, streams)
            else:
                prompts = random_prompts(runner.info.vocab_size, streams, length)
            row = compare(runner, prompts, args, eos, spec)
            row.update(workload=workload, streams=streams, prompt_tokens=length)
            row.update(method=args.method, dtype=runner.info.dtype_name)
            if args.method == "draft_model":
                row.update(draft_layers=args.draft_layers)
            print(json.dumps(row), flush=True)


def each_task(runner, tok, args, eos, spec, length: int) -> None:
    """Batch 1, each grounded task's prompt in turn (one row each), then all of them together:
    ms per token over every task's tokens (each task's ms/token weighted by its tokens)."""
    rows = []
    for i, task in enumerate(TASKS):
        row = compare(runner, grounded_prompts(tok, 1, start=i), args, eos, spec)
        row.update(workload=f"grounded task {i}", task=task[:40], streams=1, prompt_tokens=length)
        print(json.dumps(row), flush=True)
        rows.append(row)
    tokens = sum(r["output_tokens"] for r in rows)
    total = {}
    for key in (
        "ms_per_token_off",
        "ms_per_token_on",
        "cpu_ms_per_token_off",
        "cpu_ms_per_token_on",
    ):
        total[key] = round(sum(r[key] * r["output_tokens"] for r in rows) / tokens, 3)
    total["speedup"] = round(total["ms_per_token_off"] / total["ms_per_token_on"], 3)
    total["cpu_speedup"] = round(total["cpu_ms_per_token_off"] / total["cpu_ms_per_token_on"], 3)
    total.update(workload="grounded, all tasks", streams=1, output_tokens=tokens)
    print(json.dumps(total), flush=True)


if __name__ == "__main__":
    main()
