"""`echo` with `logprobs` on /v1/completions, as vLLM answers it: the logprobs object covers the
prompt's tokens (from the scheduler's prompt logprobs) before the generated ones. This is how
evaluators (lm-eval's loglikelihood) score a prompt: `echo=true, logprobs=k, max_tokens=0`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from client.outputs import Logprob

__all__ = ["logprobs_object", "prompt_echo_logprobs", "top_with_chosen"]


def top_with_chosen(entry: dict[int, Logprob], chosen: int, text: str, k: int) -> dict[str, float]:
    """The `k` most likely alternatives by text, plus the chosen token when it is not among
    them (OpenAI and vLLM include it: a client compares it with the best to tell greedy)."""
    ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    top: dict[str, float] = {}
    for lp in ranked[:k]:
        # Tokens that decode alike (byte pieces as "\ufffd") share a key: the likelier keeps it.
        top.setdefault(lp.decoded_token or "", lp.logprob)
    if chosen in entry:
        top.setdefault(text, entry[chosen].logprob)
    return top


def logprobs_object(
    rows: Iterable[tuple[int, str, dict[int, Logprob] | None, int]], text_offset: int
) -> dict[str, Any]:
    """The completions API's logprobs object over (token id, text, entry, k) rows: an entry of
    None gives a null logprob and top; offsets count on from ``text_offset``."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for tid, text, entry, k in rows:
        tokens.append(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(entry[tid].logprob if tid in entry else None)
            tops.append(top_with_chosen(entry, tid, text, k))
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_echo_logprobs(
    token_ids: list[int],
    token_texts: list[str],
    prompt_logprobs: list[dict[int, Logprob] | None] | None,
    k: int,
) -> dict[str, Any]:
    """The completions logprobs object for the prompt's tokens: the first has no prediction
    (null logprob and top), the others their logprob and top `k`. Offsets count from the start
    of the prompt's token texts, as vLLM counts them."""
    entries = prompt_logprobs or [None]
    if len(entries) != len(token_ids):
        # The scheduler sends one entry per prompt token past the first; anything else means
        # the ids here are not the prompt it computed (a tokenizer mismatch), not a client error.
        raise RuntimeError(
            f"prompt logprobs for {len(entries)} tokens, prompt has {len(token_ids)} tokens"
        )
    # The first prompt token has no prediction: null logprob and top.
    rows = (
        (tid, text, None if pos == 0 else entries[pos], k)
        for pos, (tid, text) in enumerate(zip(token_ids, token_texts, strict=True))
    )
    return logprobs_object(rows, 0)
