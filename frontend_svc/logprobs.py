"""The logprob fields of OpenAI choices (completions and chat, whole or chunked) made from
scheduler stream deltas, best_of's choice among candidates by cumulative logprob, and usage;
chat's `prompt_logprobs` on the response-field hook (response_fields.py)."""

from __future__ import annotations

from typing import Any

from client.outputs import StreamDelta
from frontend_svc.echo import logprobs_object


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _top(entry: dict) -> list[tuple[str, float]]:
    """(token text, logprob) of the top alternatives, best first."""
    ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    return [(lp.decoded_token or "", lp.logprob) for lp in ranked]


def prompt_logprobs(entries: list | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: null for the first prompt token, then {token id: {logprob,
    rank, decoded_token}} per token (the prompt token itself and the top alternatives)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in e.items()
        }
        for e in entries
    ]


def completion_logprobs(
    delta: StreamDelta, token_texts: list[str], text_offset: int
) -> dict[str, Any]:
    """The completions API's logprobs object for the tokens of one delta."""
    rows = (
        (tid, text, entry, len(entry))
        for tid, text, entry in zip(
            delta.token_ids, token_texts, delta.logprobs or [], strict=False
        )
    )
    return logprobs_object(rows, text_offset)


def chat_logprobs(delta: StreamDelta, token_texts: list[str]) -> list[dict[str, Any]]:
    """The chat API's logprobs.content entries for the tokens of one delta."""
    content = []
    for tid, text, entry in zip(delta.token_ids, token_texts, delta.logprobs or [], strict=False):
        content.append(
            {
                "token": text,
                "logprob": entry[tid].logprob if tid in entry else None,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in _top(entry)
                ],
            }
        )
    return content


def cumulative_logprob(delta: StreamDelta) -> float:
    """The sum of the logprobs of the tokens a delta sampled (the request asked for logprobs,
    so each entry holds its sampled token)."""
    return sum(
        entry[tid].logprob for tid, entry in zip(delta.token_ids, delta.logprobs or [], strict=True)
    )


def best_candidates(scores: dict[int, float], num_prompts: int, best_of: int, n: int) -> list[int]:
    """best_of as vLLM: of prompt i's candidates `i * best_of + j`, the `n` with the highest
    cumulative logprob, best first (ties by index, so equal greedy candidates keep their
    order); the choices of prompt i are then `i * n + rank`."""
    out: list[int] = []
    for i in range(num_prompts):
        mine = range(i * best_of, (i + 1) * best_of)
        out.extend(sorted(mine, key=lambda c: (-scores.get(c, 0.0), c))[:n])
    return out


class PromptLogprobsField:
    """A whole chat body's `prompt_logprobs` (vLLM's; null unless asked), from the delta that
    carries them (a ``ResponseField``)."""

    def __init__(self) -> None:
        self.value: list | None = None

    def add(self, d: StreamDelta) -> None:
        if d.prompt_logprobs is not None:
            self.value = prompt_logprobs(d.prompt_logprobs)

    def fields(self) -> dict[str, Any]:
        return {"prompt_logprobs": self.value}
