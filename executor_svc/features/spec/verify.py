"""Speculative decoding on the executor: verifying proposed tokens in one step.

A speculating sequence is a decode (its last known token is the one to compute) followed by k
proposed tokens, all computed in one forward as extra query positions. Every one of the 1 + k
positions is sampled: row j draws the target's token after the last known token and proposals
1..j, with the output history (penalties) and the seeded position (noise) that the sequence
would have at that point without speculation. Proposal j + 1 is accepted only when it equals
row j's draw, so every accepted token is exactly the token the non-speculative path samples
there, and the first draw after the accepted run is that path's next token too: the output is
token for token the same, greedy or seeded (``accept``).

The runner calls ``sample_rows`` (which rows of the forward are sampled) and ``row_views`` /
``group_results`` around its sampler; the servicer calls ``accept`` and ``blocks_to_keep``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from executor_svc.features.base import without_entry
from executor_svc.features.spec.view import NAME, spec_of

# model_runner's ScheduledSequence and SampleResult (it imports this module, so they are not
# named here: no import circle, even for type checkers).
ScheduledSequence = Any
SampleResult = Any

__all__ = ["accept", "blocks_to_keep", "group_results", "row_views", "sample_rows"]


def sample_rows(
    seqs: Sequence[ScheduledSequence], sample_seq_indices: list[int], query_start_loc: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """The forward's rows to sample: the last row of each sampling sequence, and for a
    speculating one its last 1 + k rows. Returns (sequence index of each row, row indices)."""
    ends = query_start_loc[1:].tolist()
    idx: list[int] = []
    rows: list[int] = []
    for i in sample_seq_indices:
        k = len(spec_of(seqs[i]).spec_token_ids)
        idx.extend([i] * (k + 1))
        rows.extend(range(ends[i] - 1 - k, ends[i]))
    return idx, torch.tensor(rows, dtype=torch.long)


def row_views(
    seqs: Sequence[ScheduledSequence], sample_seq_indices: list[int]
) -> list[ScheduledSequence]:
    """One sequence per sampled row, seen as the non-speculative path sees it at that row: the
    known tokens and the proposals before the row (the sampler reads the output's length as
    the seeded position and, for penalties, the output itself)."""
    views: list[ScheduledSequence] = []
    prev = -1
    j = 0
    for i in sample_seq_indices:
        s = seqs[i]
        j = j + 1 if i == prev else 0
        prev = i
        k = len(spec_of(s).spec_token_ids)
        if not k:
            views.append(s)
            continue
        # s.token_ids holds the known tokens and then the k proposals.
        views.append(
            dataclasses.replace(
                s,
                token_ids=s.token_ids[: len(s.token_ids) - k + j],
                step_data=without_entry(s, NAME),
            )
        )
    return views


def group_results(results: list[SampleResult], sample_seq_indices: list[int]) -> list[SampleResult]:
    """Rows back to one result per sequence: the first row's, with the others as its
    ``spec`` (the draw after each proposal, in order)."""
    grouped: list[SampleResult] = []
    prev = -1
    for r, i in zip(results, sample_seq_indices, strict=True):
        if i != prev:
            grouped.append(r)
            prev = i
        elif grouped[-1].spec is None:
            grouped[-1].spec = [r]
        else:
            grouped[-1].spec.append(r)
    return grouped


def accept(proposed: Sequence[int], drawn: Sequence[int]) -> int:
    """Leading proposals equal to the target's draws: proposal i is compared with the draw at
    the position before it (drawn[i]). The tokens kept are drawn[: accepted + 1]."""
    n = 0
    for p, d in zip(proposed, drawn, strict=False):
        if p != d:
            break
        n += 1
    return n


def blocks_to_keep(num_blocks: int, num_tokens: int, block_size: int) -> int:
    """Blocks a sequence keeps after a verifying step: those its known tokens need (the next
    step computes the last of them), never more than it has. The scheduler's block manager
    applies the same rule (``BlockManager.truncate``), so both tables stay equal."""
    return min(num_blocks, -(-num_tokens // block_size))
