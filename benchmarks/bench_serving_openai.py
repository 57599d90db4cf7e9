"""Serving throughput of any OpenAI-compatible server with one client: N concurrent streams of
text prompts to ``/v1/completions`` (greedy, ``max_tokens`` each), output tokens per second of
wall clock (from each answer's ``usage.completion_tokens``).

Text prompts, not token ids, so that servers that take only text (llama-cpp-python's) get the
same requests; each server tokenizes them itself (same GGUF tokenizer here).

    .venv/bin/python benchmarks/bench_serving_openai.py --base-url http://127.0.0.1:8000/v1 \\
        --concurrency 32 --requests 32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

WORDS = [
    "river",
    "mountain",
    "engine",
    "library",
    "garden",
    "window",
    "history",
    "science",
    "music",
    "ocean",
    "silver",
    "planet",
    "market",
    "winter",
    "forest",
    "letter",
    "bridge",
    "theory",
    "island",
    "summer",
]


def prompt(i: int, words: int) -> str:
    body = " ".join(WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(words))
    return f"Write a long story that uses these words: {body}. Story:"


async def run(base_url: str, concurrency: int, requests: int, max_tokens: int, words: int):
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)
        tokens = []

        async def one(i: int) -> None:
            async with sem:
                r = await client.post(
                    "/completions",
                    json={"model": model, "prompt": prompt(i, words), "max_tokens": max_tokens,
                          "temperature": 0.0},
                )  # fmt: skip
                r.raise_for_status()
                tokens.append(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    return sum(tokens), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=40)
    args = parser.parse_args()
    total, wall = asyncio.run(
        run(args.base_url, args.concurrency, args.requests, args.max_tokens, args.prompt_words)
    )
    print(
        f"{args.base_url}: {args.requests} requests, {args.concurrency} concurrent: {total} "
        f"output tokens in {wall:.1f} s = {total / wall:.1f} tokens/s"
    )


if __name__ == "__main__":
    main()
