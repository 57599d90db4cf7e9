"""Builders for Batch API tests: JSONL input lines of every kind, waiting for a batch, reading
an output file, and the one normalisation the comparisons allow (fields fresh by nature)."""

from __future__ import annotations

import json
import time
from typing import Any

import openai

# Fresh on every call, by nature: a response's own id and creation time. Everything else of a
# line's body must be equal byte for byte (as canonical JSON) to the interactive answer's.
FRESH_FIELDS = ("id", "created")


def line_body(i: int, model: str, max_tokens: int = 8) -> tuple[str, dict[str, Any]]:
    """Line `i`'s (url, body): chat, completions and embeddings in turn, greedy and seeded."""
    kind = i % 3
    sampling: dict[str, Any] = (
        {"temperature": 0.0} if (i // 3) % 2 == 0 else {"temperature": 0.9, "seed": 1000 + i}
    )
    common = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    if kind == 0:
        messages = [{"role": "user", "content": f"Tell story {i}."}]
        return "/v1/chat/completions", {**common, "messages": messages}
    if kind == 1:
        return "/v1/completions", {**common, "prompt": f"Once upon a time {i}"}
    return "/v1/embeddings", {"model": model, "input": f"embed me {i}"}


def jsonl(model: str, n: int, max_tokens: int = 8) -> bytes:
    rows = []
    for i in range(n):
        url, body = line_body(i, model, max_tokens)
        rows.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def wait_batch(oai: openai.OpenAI, batch_id: str, until: set[str], timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        b = oai.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b}"
        time.sleep(0.2)


def read_lines(oai: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = oai.files.content(file_id).content.decode()
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def canonical(body: dict[str, Any]) -> str:
    """A response body as canonical JSON without its fresh fields."""
    return json.dumps({k: v for k, v in body.items() if k not in FRESH_FIELDS}, sort_keys=True)
