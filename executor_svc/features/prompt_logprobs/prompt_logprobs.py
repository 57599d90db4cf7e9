"""Prompt logprobs: the log-probability of each prompt token under the model (and the top
alternatives), from the hidden states of a step's prefill rows, through the LM head in passes
of at most ``PROMPT_LOGPROB_ROWS`` rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from executor_svc.kernels import sampling

# model_runner's ScheduledSequence (it imports this module: not named here, no import circle).
ScheduledSequence = Any

# Prompt-logprob rows go through the LM head this many at a time: [rows, vocab] fp32 logits of
# a whole 8k-token chunk would be gigabytes.
PROMPT_LOGPROB_ROWS = 256


@dataclass(slots=True)
class PromptLogprobResult:
    """Logprobs of prompt tokens first_position, first_position + 1, ... of one sequence."""

    seq_id: str
    first_position: int
    logprobs: list[float]  # of each prompt token, raw distribution
    top: list[list[tuple[int, float]]]  # per token: num_prompt_logprobs alternatives


def chunks(seqs: list[ScheduledSequence]) -> list[tuple[int, int, int, int, int]]:
    """The LM-head passes prompt logprobs take, in order: (sequence index, k, first position a,
    end position b, batch row of position a). The row at position p predicts the prompt token
    at p + 1, for p + 1 < num_prompt_tokens (the last prompt position predicts the first
    output, which the sampler handles)."""
    out = []
    row = 0
    for i, s in enumerate(seqs):
        k = s.sampling_params.num_prompt_logprobs
        start, n = s.num_computed_tokens, s.num_scheduled_tokens
        end = min(start + n, s.num_prompt_tokens - 1)
        if k is not None:
            for a in range(start, end, PROMPT_LOGPROB_ROWS):
                out.append((i, k, a, min(a + PROMPT_LOGPROB_ROWS, end), row + a - start))
        row += n
    return out


def compute(
    model: Any, seqs: list[ScheduledSequence], hidden: torch.Tensor
) -> list[PromptLogprobResult]:
    """Prompt logprobs of the sequences that ask (see ``chunks``); ``model.compute_logits``
    is the LM head."""
    by_seq: dict[int, PromptLogprobResult] = {}
    for i, k, a, b, row in chunks(seqs):
        s = seqs[i]
        res = by_seq.get(i)
        if res is None:
            res = by_seq[i] = PromptLogprobResult(s.seq_id, a + 1, [], [])
        logits = model.compute_logits(hidden[row : row + b - a]).float()
        lse = sampling.row_logsumexp(logits)
        targets = torch.tensor(s.token_ids[a + 1 : b + 1], device=logits.device)
        lps = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
        res.logprobs.extend(lps.tolist())
        if k > 0:
            vals, ids = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
            top_lps = (vals - lse[:, None]).tolist()
            res.top.extend(
                list(zip(i_, v, strict=True)) for i_, v in zip(ids.tolist(), top_lps, strict=True)
            )
        else:
            res.top.extend([] for _ in range(b - a))
    return list(by_seq.values())
