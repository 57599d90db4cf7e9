"""`vllm`: vLLM's offline ``LLM`` engine on the same requests, for throughput comparisons.

vLLM is not a dependency of this project: it runs in a subprocess with the Python of its own
virtualenv (``--vllm-python``; ``make vllm-venv`` builds one), through ``vllm_runner.py``, which
needs nothing but vLLM. The requests travel as a JSON file; the subprocess warms up, times one
``generate`` call over all of them and writes the result back. Only the throughput mode is
supported: an offline engine has no arrival schedule.

CPU settings follow vLLM's own: ``VLLM_CPU_OMP_THREADS_BIND`` (the cores its compute threads
are pinned to) and ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import client.envs as envs
from client.bench.metrics import RequestRecord
from client.bench.workloads import BenchRequest

RUNNER = Path(__file__).with_name("vllm_runner.py")


class VLLMBackend:
    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        python: str | Path,
        max_num_seqs: int = 256,
        cpu_cores: str = "0",
        kv_cache_gib: int = 4,
        dtype: str = "float32",
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.python = str(python)
        if not Path(self.python).exists():
            raise ValueError(f"--vllm-python {self.python} does not exist (see `make vllm-venv`)")
        self.cpu_cores = cpu_cores
        self.kv_cache_gib = kv_cache_gib
        self._max_model_len = max_model_len
        # fp32 on purpose: vLLM's CPU backend otherwise runs fp32 checkpoints in bf16.
        self.llm_args: dict[str, Any] = {
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
            "enforce_eager": enforce_eager,
            "enable_prefix_caching": enable_prefix_caching,
            "seed": 0,
        }
        # Prompts are token ids; a checkpoint without tokenizer files runs without detokenizing.
        if not any((self.model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
            self.llm_args["skip_tokenizer_init"] = True

    def limits(self) -> tuple[int, int]:
        config = json.loads((self.model_dir / "config.json").read_text())
        config = config.get("text_config", config)
        max_len = int(config.get("max_position_embeddings", 2048))
        if self._max_model_len is not None:
            max_len = min(max_len, self._max_model_len)
        return int(config["vocab_size"]), max_len

    def warmup(self) -> None:
        pass  # the subprocess warms up itself, inside the process that is then timed

    def run(
        self,
        requests: list[BenchRequest],
        offsets: list[float],
        *,
        max_concurrency: int | None = None,
        progress: bool = True,
    ) -> tuple[list[RequestRecord], float]:
        if any(offsets) or max_concurrency:
            raise ValueError("the vllm backend runs the throughput mode only (all at once)")
        _, max_len = self.limits()
        args = dict(self.llm_args, max_model_len=max_len)
        with tempfile.TemporaryDirectory(prefix="llmserve-vllm-") as tmp:
            job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
            job.write_text(
                json.dumps(
                    {
                        "model": str(self.model_dir),
                        "requests": [[r.prompt_token_ids, r.output_len] for r in requests],
                        "llm_args": args,
                    }
                )
            )
            defaults = {
                "VLLM_CPU_OMP_THREADS_BIND": self.cpu_cores,
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),  # whole GiB only
                "HF_HUB_OFFLINE": "1",
            }
            # Its own virtualenv only: no llmserve paths leaking into vLLM's imports.
            env = envs.child_environment(defaults, drop=("PYTHONPATH",))
            subprocess.run(
                [self.python, str(RUNNER), str(job), str(result)],
                env=env,
                check=True,
                stdout=None if progress else subprocess.DEVNULL,
            )
            out = json.loads(result.read_text())
        return _records(requests, out), float(out["duration_s"])

    def close(self) -> None:
        pass


def _records(requests: list[BenchRequest], out: dict[str, Any]) -> list[RequestRecord]:
    """One record per request, on a clock that starts at 0 when ``generate`` was called.

    Offline vLLM reports no per-token times: tokens are spread evenly between a request's first
    and last token when it reports those, else all stamped at the end of the run (so only the
    throughput figures are meaningful then).
    """
    base = time.perf_counter() - float(out["duration_s"])
    firsts, finishes = out.get("first_token_s"), out.get("finish_s")
    records = []
    for i, (req, n) in enumerate(zip(requests, out["output_lens"], strict=True)):
        rec = RequestRecord(req.prompt_len, req.output_len, base)
        end = base + (finishes[i] if finishes else float(out["duration_s"]))
        first = base + firsts[i] if firsts else end
        step = (end - first) / (n - 1) if n > 1 else 0.0
        rec.token_times = [first + k * step for k in range(n)]
        rec.end_time = end
        rec.success = n == req.output_len
        if not rec.success:
            rec.error = f"generated {n} of {req.output_len} tokens"
        records.append(rec)
    return records
