"""Batch-1 decode on a GGUF file: llmserve (weights kept quantized) vs llama.cpp, and vs our own
fp32 on the same model de-quantized, one thread each.

Each engine prefills the same 512-token prompt, then decodes 128 tokens greedily (EOS ignored);
the number is decode time / 128 in ms/token, the prompt's prefill reported apart.

* llmserve: ``ModelRunner.execute`` steps (input preparation, forward, logits, greedy sampling)
  on the GGUF (``--model file.gguf`` path) and on an fp32 checkpoint directory of the same model
  (``--fp32-dir``, e.g. tests/support/smollm2.py's conversion), in this process.
* The fp32 directory runs with ``dtype="float32"`` (``auto`` is bf16 on a CPU with AVX512-BF16
  or AMX); ``--bf16`` adds it in bfloat16.
* ``--int8``: the fp32 directory again with ``--quantization int8`` (its matrices as Q8_0 blocks
  at load), reported against fp32.
* ``--act8``: the GGUF again with ``LLMSERVE_QUANT_ACT=int8`` (activations quantized to int8 per
  group of 32, integer dot products; kernels/quant.py), reported against llama.cpp and fp32.
* llama.cpp: ``llama-cpp-python`` in a venv of its own (``--llamacpp-python``, never a dependency
  of llmserve), run as a subprocess with ``n_threads=1``: ``eval`` of the prompt, then
  ``sample`` (greedy) + ``eval`` per token. Repeat ``--llamacpp-python LABEL=PATH`` for several
  builds in one run (e.g. ``native=...`` and ``avx2=...``); each is an engine "llama.cpp LABEL".

Engines alternate ``--repeats`` times and medians are shown, so load from other processes hits
all alike; the decode's CPU time (``time.process_time`` of each engine's process) is shown too,
the fairer number on a shared machine (time waiting for a core is not counted). Pin the process for stable numbers:

    taskset -c 0 .venv/bin/python benchmarks/bench_vs_llamacpp.py --gguf FILE.gguf \\
        --fp32-dir ~/.cache/llmserve/smollm2-135m-instruct/SmolLM2-135M-Instruct \\
        --llamacpp-python /work/llamacpp-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402

BLOCK_SIZE = 16

LLAMACPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, prompt_len, out_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=1, n_threads_batch=1, n_ctx=prompt_len + out_len + 16,
            n_batch=prompt_len + out_len + 16, verbose=False)
prompt = [(7 * i + 3) % 40000 + 100 for i in range(prompt_len)]
llm.reset()
t0, c0 = time.perf_counter(), time.process_time()
llm.eval(prompt)
t1, c1 = time.perf_counter(), time.process_time()
tok = int(llm.scores[llm.n_tokens - 1].argmax())
for _ in range(out_len):
    llm.eval([tok])
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"prefill_s": t1 - t0, "decode_ms": (t2 - t1) * 1000 / out_len,
                  "decode_cpu_ms": (c2 - c1) * 1000 / out_len}))
"""


def ours(
    model: str,
    prompt_len: int,
    out_len: int,
    batch: int = 1,
    quantization: str | None = None,
    dtype: str = "auto",
    quant_act: str = "fp32",
) -> dict[str, float]:
    """Prefill + greedy decode with ModelRunner; ``batch`` copies of the prompt decode together;
    ``quant_act``: LLMSERVE_QUANT_ACT while the model loads (its QuantWeights keep it)."""
    from executor_svc.api.server import resolve_model

    model_dir, _ = resolve_model(model)
    blocks = -(-(prompt_len + out_len + 1) // BLOCK_SIZE)
    saved = os.environ.get("LLMSERVE_QUANT_ACT")
    os.environ["LLMSERVE_QUANT_ACT"] = quant_act
    try:
        runner = ModelRunner(
            model_dir,
            num_device_blocks=blocks * batch + 1,
            swap_space_gib=0.01,
            quantization=quantization,
            dtype=dtype,
        )
    finally:
        if saved is None:
            del os.environ["LLMSERVE_QUANT_ACT"]
        else:
            os.environ["LLMSERVE_QUANT_ACT"] = saved
    prompt = [(7 * i + 3) % 40000 + 100 for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0)
    seqs = [
        ScheduledSequence(
            str(b),
            list(prompt),
            prompt_len,
            list(range(b * blocks, (b + 1) * blocks)),
            0,
            prompt_len,
            params,
        )  # fmt: skip
        for b in range(batch)
    ]
    t0 = time.perf_counter()
    out = runner.execute(seqs, [], [], [])
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(out_len):
        for s, o in zip(seqs, out, strict=True):
            s.token_ids.append(o.token_id)
            s.num_computed_tokens += s.num_scheduled_tokens
            s.num_scheduled_tokens = 1
        out = runner.execute(seqs, [], [], [])
    t2, c2 = time.perf_counter(), time.process_time()
    return {
        "prefill_s": t1 - t0,
        "decode_ms": (t2 - t1) * 1000 / out_len,
        "decode_cpu_ms": (c2 - c1) * 1000 / out_len,
    }


def llamacpp(python: str, gguf: str, prompt_len: int, out_len: int) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [python, "-c", LLAMACPP_SCRIPT, gguf, str(prompt_len), str(out_len)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--fp32-dir", default=None)
    parser.add_argument("--llamacpp-python", action="append", default=[])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--out-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="llmserve sequences decoding together")
    parser.add_argument(
        "--int8", action="store_true", help="also --fp32-dir with --quantization int8"
    )
    parser.add_argument("--bf16", action="store_true", help="also --fp32-dir in bfloat16")
    parser.add_argument(
        "--act8", action="store_true", help="also the GGUF with LLMSERVE_QUANT_ACT=int8"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    engines = {"llmserve gguf": lambda: ours(args.gguf, args.prompt_len, args.out_len, args.batch)}
    if args.act8:
        engines["llmserve gguf act8"] = lambda: ours(
            args.gguf, args.prompt_len, args.out_len, args.batch, quant_act="int8"
        )
    if args.fp32_dir:  # float32 forced: auto is bf16 on a CPU with AVX512-BF16 or AMX
        engines["llmserve fp32"] = lambda: ours(
            args.fp32_dir, args.prompt_len, args.out_len, args.batch, dtype="float32"
        )
    if args.fp32_dir and args.bf16:
        engines["llmserve bf16"] = lambda: ours(
            args.fp32_dir, args.prompt_len, args.out_len, args.batch, dtype="bfloat16"
        )
    if args.fp32_dir and args.int8:
        engines["llmserve int8"] = lambda: ours(
            args.fp32_dir, args.prompt_len, args.out_len, args.batch, "int8"
        )
    for spec in args.llamacpp_python:
        label, _, python = spec.rpartition("=")
        engines[f"llama.cpp {label}".strip()] = lambda python=python: llamacpp(
            python, args.gguf, args.prompt_len, args.out_len
        )
    results: dict[str, list[dict[str, float]]] = {k: [] for k in engines}
    for r in range(args.repeats):
        for name, fn in engines.items():
            results[name].append(fn())
            print(f"round {r} {name}: {results[name][-1]}", flush=True)
    print(f"\nprompt {args.prompt_len}, {args.out_len} out, batch {args.batch}, 1 thread")
    print("| engine | decode ms/token, wall | decode ms/token, CPU time | prefill s, wall |")
    print("| --- | --- | --- | --- |")
    med, cpu = {}, {}
    for name, rs in results.items():
        med[name] = statistics.median(x["decode_ms"] for x in rs)
        cpu[name] = statistics.median(x["decode_cpu_ms"] for x in rs)
        pre = statistics.median(x["prefill_s"] for x in rs)
        print(f"| {name} | {med[name]:.2f} | {cpu[name]:.2f} | {pre:.3f} |")
    if "llmserve int8" in med:
        print(
            f"llmserve int8 tokens/s vs llmserve fp32: "
            f"{med['llmserve fp32'] / med['llmserve int8']:.2f}x wall, "
            f"{cpu['llmserve fp32'] / cpu['llmserve int8']:.2f}x CPU time"
        )
    peers = [n for n in med if n not in ("llmserve int8", "llmserve bf16")]
    for ours_name in ("llmserve gguf", "llmserve gguf act8"):
        for name in peers:
            if ours_name in med and not name.startswith("llmserve gguf"):
                print(
                    f"{ours_name} tokens/s vs {name}: {med[name] / med[ours_name]:.2f}x wall, "
                    f"{cpu[name] / cpu[ours_name]:.2f}x CPU time"
                )


if __name__ == "__main__":
    main()
