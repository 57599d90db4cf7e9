"""Systems under test: `llmserve` over gRPC and `hf` (transformers `generate`, in-process).

Both run the same list of requests against a schedule of send times (all zero for the
throughput mode) and return one RequestRecord per request plus the wall time of the run.
Both decode greedily and generate exactly each request's `output_len` tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from client.async_client import AsyncLLMClient
from client.bench.dispatch import send_on_schedule
from client.bench.metrics import RequestRecord
from client.bench.workloads import BenchRequest
from client.errors import LLMServeError
from client.params import SamplingParams

BACKENDS = ("llmserve", "hf", "openai", "vllm")


class Backend(Protocol):
    name: str

    def limits(self) -> tuple[int, int]:
        """(vocab_size, max_model_len) of the model being served."""
        ...

    def warmup(self) -> None: ...

    def run(
        self,
        requests: list[BenchRequest],
        offsets: list[float],
        *,
        max_concurrency: int | None = None,
        progress: bool = True,
    ) -> tuple[list[RequestRecord], float]: ...

    def close(self) -> None: ...


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, dynamic_ncols=True)


class LLMServeBackend:
    """The whole stack through the public API; token times are when each stream delta arrives."""

    name = "llmserve"

    def __init__(self, address: str | None = None, *, ready_timeout: float = 60.0):
        self.address = address
        self.ready_timeout = ready_timeout
        self._info: Any = None

    async def _server_info(self) -> Any:
        async with AsyncLLMClient(self.address) as client:
            await client.wait_ready(self.ready_timeout)
            return await client.server_info()

    def limits(self) -> tuple[int, int]:
        if self._info is None:
            self._info = asyncio.run(self._server_info())
        return self._info.vocab_size, self._info.max_model_len

    def warmup(self) -> None:
        vocab_size, _ = self.limits()
        warm = [BenchRequest([i % vocab_size for i in range(1, 9)], 4)]
        self.run(warm, [0.0], progress=False)

    def run(
        self,
        requests: list[BenchRequest],
        offsets: list[float],
        *,
        max_concurrency: int | None = None,
        progress: bool = True,
    ) -> tuple[list[RequestRecord], float]:
        return asyncio.run(self._run(requests, offsets, max_concurrency, progress))

    async def _run(
        self,
        requests: list[BenchRequest],
        offsets: list[float],
        max_concurrency: int | None,
        progress: bool,
    ) -> tuple[list[RequestRecord], float]:
        run_id = uuid.uuid4().hex[:8]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = _progress(len(requests), "llmserve", progress)
        records = [RequestRecord(r.prompt_len, r.output_len, 0.0) for r in requests]

        async with AsyncLLMClient(self.address) as client:

            async def one(i: int, arrival: float) -> None:
                req, rec = requests[i], records[i]
                params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)
                # Latency counts from the scheduled arrival, as for hf: waiting for a
                # --max-concurrency slot is part of what a user would see.
                rec.start_time = arrival
                if sem is not None:
                    await sem.acquire()
                try:
                    async for delta in client.stream(
                        req.prompt_token_ids, params, request_id=f"bench-{run_id}-{i}"
                    ):
                        if delta.token_ids:
                            now = time.perf_counter()
                            rec.token_times.extend([now] * len(delta.token_ids))
                        if delta.finish_reason is not None:
                            rec.success = delta.finish_reason in ("length", "stop")
                            rec.error = delta.error or ""
                except LLMServeError as err:
                    rec.success, rec.error = False, str(err)
                finally:
                    rec.end_time = time.perf_counter()
                    if sem is not None:
                        sem.release()
                    bar.update(1)

            duration = await send_on_schedule(offsets, one)
        bar.close()
        return records, duration

    def close(self) -> None:
        pass


class HFBackend:
    """Static batching with transformers, the baseline of vLLM's papers.

    Requests are taken in arrival order, up to `max_batch_size` of those that have arrived,
    left-padded into one batch and decoded greedily with `max_new_tokens = min_new_tokens =`
    the longest output in the batch (the minimum masks EOS, so every row runs to the end). Each
    request keeps only its own first `output_len` tokens: its token times are the batch's
    per-step times (recorded by a stopping criterion that never stops) and it counts as finished
    at its own last token, as if the server streamed. Its slot stays busy until the batch ends,
    which is exactly the cost of static batching that continuous batching removes.
    """

    name = "hf"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_size: int = 256,
        device: str = "auto",
        dtype: str = "float32",
    ):
        import torch
        from transformers import AutoModelForCausalLM

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).to(self.device)
        self.model.eval()
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = int(text_config.vocab_size)
        self.max_model_len = int(getattr(text_config, "max_position_embeddings", 2048))
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(text_config, "eos_token_id", None)
        self.eos_token_id = eos
        pad = getattr(self.model.generation_config, "pad_token_id", None)
        if pad is None:
            pad = getattr(text_config, "pad_token_id", None)
        if pad is None:
            pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
        self.pad_token_id = int(pad)

    @classmethod
    def read_limits(cls, model_dir: str | Path) -> tuple[int, int]:
        """(vocab_size, max_model_len) from config.json, without loading weights."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config = config.get("text_config", config)
        return int(config["vocab_size"]), int(config.get("max_position_embeddings", 2048))

    def limits(self) -> tuple[int, int]:
        return self.vocab_size, self.max_model_len

    def warmup(self) -> None:
        self._generate([BenchRequest(list(range(1, 9)), 4)], [RequestRecord(8, 4, 0.0)])

    def _generate(self, batch: list[BenchRequest], records: list[RequestRecord]) -> None:
        import torch
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        step_times: list[float] = []

        class StepTimer(StoppingCriteria):
            # Called once per decoding step, right after the new tokens are appended.
            def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> Any:
                step_times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        max_prompt = max(r.prompt_len for r in batch)
        max_new = max(r.output_len for r in batch)
        input_ids = torch.full((len(batch), max_prompt), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), max_prompt), dtype=torch.long)
        for row, req in enumerate(batch):
            input_ids[row, max_prompt - req.prompt_len :] = torch.tensor(req.prompt_token_ids)
            attention_mask[row, max_prompt - req.prompt_len :] = 1
        gen_config = GenerationConfig(
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
        )
        try:
            with torch.inference_mode():
                self.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention_mask.to(self.device),
                    generation_config=gen_config,
                    stopping_criteria=StoppingCriteriaList([StepTimer()]),
                )
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as err:  # a failed batch fails its requests, not the benchmark
            end = time.perf_counter()
            for rec in records:
                rec.success, rec.error, rec.end_time = False, f"{type(err).__name__}: {err}", end
            return
        for req, rec in zip(batch, records, strict=True):
            rec.token_times = step_times[: req.output_len]
            rec.success = len(rec.token_times) == req.output_len
            rec.end_time = rec.token_times[-1] if rec.token_times else time.perf_counter()
            if not rec.success:
                rec.error = f"generated {len(rec.token_times)} of {req.output_len} tokens"

    def run(
        self,
        requests: list[BenchRequest],
        offsets: list[float],
        *,
        max_concurrency: int | None = None,
        progress: bool = True,
    ) -> tuple[list[RequestRecord], float]:
        batch_size = min(self.max_batch_size, max_concurrency or self.max_batch_size)
        bar = _progress(len(requests), "hf", progress)
        records = [RequestRecord(r.prompt_len, r.output_len, 0.0) for r in requests]
        order = deque(sorted(range(len(requests)), key=lambda i: offsets[i]))
        start = time.perf_counter()
        while order:
            now = time.perf_counter() - start
            if offsets[order[0]] > now:
                time.sleep(offsets[order[0]] - now)
                continue
            batch_ids: list[int] = []
            max_prompt = max_out = 0
            while order and len(batch_ids) < batch_size and offsets[order[0]] <= now:
                nxt = requests[order[0]]
                # Every row runs for the batch's longest output on top of the longest prompt's
                # padding; keep that within the model's length (as vLLM's HF baseline does).
                longest = max(max_prompt, nxt.prompt_len) + max(max_out, nxt.output_len)
                if batch_ids and longest > self.max_model_len:
                    break
                max_prompt = max(max_prompt, nxt.prompt_len)
                max_out = max(max_out, nxt.output_len)
                batch_ids.append(order.popleft())
            for i in batch_ids:
                # Latency counts from arrival: waiting for the previous batch is queueing.
                records[i].start_time = start + offsets[i]
            self._generate([requests[i] for i in batch_ids], [records[i] for i in batch_ids])
            bar.update(len(batch_ids))
        duration = time.perf_counter() - start
        bar.close()
        return records, duration

    def close(self) -> None:
        self.model = None


def make_backend(
    name: str,
    *,
    address: str | None = None,
    model_dir: str | Path | None = None,
    max_batch_size: int = 256,
    hf_device: str = "auto",
    hf_dtype: str = "float32",
    base_url: str | None = None,
    vllm: dict[str, Any] | None = None,
) -> Backend:
    if name == "llmserve":
        return LLMServeBackend(address)
    if name == "hf":
        if model_dir is None:
            raise ValueError("--backend hf needs --model-dir (the checkpoint llmserve serves)")
        return HFBackend(model_dir, max_batch_size=max_batch_size, device=hf_device, dtype=hf_dtype)
    if name == "openai":
        from client.bench.openai_backend import OpenAIBackend

        if base_url is None:
            raise ValueError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        return OpenAIBackend(base_url, model_dir=model_dir)
    if name == "vllm":
        from client.bench.vllm_backend import VLLMBackend

        vllm = dict(vllm or {})
        if model_dir is None or not vllm.get("python"):
            raise ValueError("--backend vllm needs --model-dir and --vllm-python")
        return VLLMBackend(model_dir, max_num_seqs=max_batch_size, **vllm)
    raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
