"""Run a benchmark's requests through vLLM's offline ``LLM`` and report the timings as JSON.

Executed by ``client.bench.vllm_backend`` with the Python of a separate virtualenv that has
vLLM installed (``make vllm-venv``), never imported by llmserve: it uses only the standard
library and vLLM, so that virtualenv needs no copy of this project.

    VLLM_CPU_OMP_THREADS_BIND=0 VLLM_CPU_KVCACHE_SPACE=4 \
        /path/to/vllm-venv/bin/python client/bench/vllm_runner.py job.json result.json

``job.json``: ``{"model": dir, "requests": [[prompt ids, output_len], ...], "llm_args": {...}}``.
``result.json``: ``{"duration_s", "output_lens": [...], "first_token_s": [...] | null,
"finish_s": [...] | null}`` (times since the start of the timed ``generate`` call).
"""

from __future__ import annotations

import json
import sys
import time


def _request_times(outputs, start: float) -> tuple[list | None, list | None]:
    # V1 offline outputs may carry per-request stats (monotonic clock); use them when present.
    firsts, finishes = [], []
    for out in outputs:
        metrics = getattr(out, "metrics", None)
        first = getattr(metrics, "first_token_ts", None) if metrics else None
        last = getattr(metrics, "last_token_ts", None) if metrics else None
        if not first or not last:
            return None, None
        firsts.append(first - start)
        finishes.append(last - start)
    return firsts, finishes


def main(job_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    llm = LLM(model=job["model"], **job.get("llm_args", {}))
    prompts = [{"prompt_token_ids": ids} for ids, _ in job["requests"]]
    detokenize = not job.get("llm_args", {}).get("skip_tokenizer_init", False)
    params = [
        SamplingParams(
            max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=detokenize
        )
        for _, n in job["requests"]
    ]
    # Warm-up outside the timed run (first-call compilation, allocator growth).
    llm.generate(
        [{"prompt_token_ids": list(range(1, 9))}],
        SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, detokenize=detokenize),
        use_tqdm=False,
    )
    start_mono = time.monotonic()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    firsts, finishes = _request_times(outputs, start_mono)
    result = {
        "duration_s": duration,
        "output_lens": [len(o.outputs[0].token_ids) for o in outputs],
        "first_token_s": firsts,
        "finish_s": finishes,
        "vllm_version": __import__("vllm").__version__,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
