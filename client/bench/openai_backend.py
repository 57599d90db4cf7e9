"""`openai`: any OpenAI-compatible server (llmserve's frontend, `vllm serve`, ...) driven over
HTTP with the official `openai` package, with the same workloads and metrics as the other
backends.

Prompts are sent as token ids to `/v1/completions` (vLLM and llmserve both accept them), greedy,
`ignore_eos` in the body so every request produces exactly its `output_len` tokens. Token times
are the arrival times of the stream's chunks; a chunk that carries several tokens counts its
time for each (the count comes from the final usage chunk).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

import client.envs as envs
from client.bench.dispatch import send_on_schedule
from client.bench.metrics import RequestRecord
from client.bench.workloads import BenchRequest

UNKNOWN_VOCAB = sys.maxsize


class OpenAIBackend:
    name = "openai"

    def __init__(
        self, base_url: str, *, model_dir: str | Path | None = None, api_key: str | None = None
    ) -> None:
        import openai  # the bench extra: pip install 'llmserve[bench]'

        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model_dir = model_dir
        # $LLMSERVE_API_KEY (this project's) or $OPENAI_API_KEY; servers without keys ignore it.
        api_key = api_key or envs.api_key() or envs.openai_api_key()
        self.api_key = api_key or "EMPTY"
        self._openai = openai
        sync = openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0)
        model = sync.models.list().data[0]
        self.model = model.id
        extra = model.model_extra or {}
        self.max_model_len = int(extra.get("max_model_len") or 2048)
        sync.close()

    def limits(self) -> tuple[int, int]:
        vocab = UNKNOWN_VOCAB
        if self.model_dir is not None:
            config = json.loads((Path(self.model_dir) / "config.json").read_text())
            vocab = int(config.get("text_config", config)["vocab_size"])
        return vocab, self.max_model_len

    def warmup(self) -> None:
        self.run([BenchRequest(list(range(1, 9)), 4)], [0.0], progress=False)

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
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(
            total=len(requests), desc="openai", unit="req", disable=not progress,
            dynamic_ncols=True,
        )  # fmt: skip
        records = [RequestRecord(r.prompt_len, r.output_len, 0.0) for r in requests]
        client = self._openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=3600
        )

        async def one(i: int, arrival: float) -> None:
            req, rec = requests[i], records[i]
            rec.start_time = arrival
            if sem is not None:
                await sem.acquire()
            try:
                stream = await client.completions.create(
                    model=self.model,
                    prompt=req.prompt_token_ids,
                    max_tokens=req.output_len,
                    temperature=0.0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                times: list[float] = []
                num_tokens = None
                finish = None
                async for chunk in stream:
                    if chunk.choices:
                        choice = chunk.choices[0]
                        if choice.text or choice.finish_reason is None:
                            times.append(time.perf_counter())
                        finish = choice.finish_reason or finish
                    if chunk.usage is not None:
                        num_tokens = chunk.usage.completion_tokens
                if num_tokens is not None and times:
                    times = (times + [times[-1]] * num_tokens)[:num_tokens]
                rec.token_times.extend(times)
                rec.success = finish in ("length", "stop")
                if not rec.success:
                    rec.error = f"finish_reason={finish}"
            except self._openai.OpenAIError as err:
                rec.success, rec.error = False, str(err)
            finally:
                rec.end_time = time.perf_counter()
                if sem is not None:
                    sem.release()
                bar.update(1)

        duration = await send_on_schedule(offsets, one)
        await client.close()
        bar.close()
        return records, duration

    def close(self) -> None:
        pass
