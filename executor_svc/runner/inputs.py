"""Flattening one step's sequences into the model's inputs (``ModelRunner.prepare_inputs``).

Per-sequence Python work only, never per token. On CUDA every tensor is built on the host and
copied from pinned memory without blocking: a plain ``.to(cuda)`` of pageable memory waits for
the whole stream, which would make the host wait for the step still running on the GPU before
it could prepare the next one. A token sampled by a step the host has not heard back from yet
(``launched.PENDING`` in the sequence's list, ``ScheduledSequence.pending``) is gathered on the
device from that step's draws.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.runner.batch import BatchInputs
from executor_svc.runner.launched import PENDING, Launched

# The sequences are the runner's ``ScheduledSequence`` views and the features its ``Feature``
# objects, typed as Any: the runner imports this module (no import circle, even for types).
ScheduledSequence = Any
Feature = Any


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``, without waiting for the device's stream on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_inputs(
    seqs: list[ScheduledSequence],
    *,
    block_size: int,
    max_model_len: int,
    device: torch.device,
    features: Sequence[Feature] = (),
) -> BatchInputs:
    """The step's flattened inputs on ``device``; ``features``: the step's, which may change
    the rows that sample."""
    bs = block_size
    num_seqs = len(seqs)
    starts = [s.num_computed_tokens for s in seqs]
    q_lens = [s.num_scheduled_tokens for s in seqs]
    seq_lens = [a + n for a, n in zip(starts, q_lens, strict=True)]
    if min(q_lens) <= 0:
        raise ValueError("every scheduled sequence must compute at least one token")
    if max(seq_lens) > max_model_len:
        raise ValueError(f"a sequence exceeds max_model_len={max_model_len}")
    blocks_needed = [-(-n // bs) for n in seq_lens]
    max_blocks = max(blocks_needed)
    # Filled row by row in numpy: building the tensor from nested Python lists costs ~3x more,
    # which at long contexts (hundreds of blocks per sequence) is milliseconds a step.
    table = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    any_pending = False
    for i, (s, n) in enumerate(zip(seqs, blocks_needed, strict=True)):
        if len(s.block_table) < n:
            raise ValueError(f"sequence {s.seq_id} needs {n} blocks, has {len(s.block_table)}")
        # Only the blocks that hold context this step: trailing pre-allocated ones would only
        # widen the gather in attention.
        table[i, :n] = s.block_table[:n]
        any_pending = any_pending or s.pending is not None
    input_ids = list(
        itertools.chain.from_iterable(
            s.token_ids[a : a + n] for s, a, n in zip(seqs, starts, q_lens, strict=True)
        )
    )
    num_tokens = len(input_ids)
    if num_tokens != sum(q_lens):
        raise ValueError("num_computed + num_scheduled exceeds the known tokens")
    # A placeholder is only ever appended with its sequence's ``pending`` set: without one in
    # the step (every step of an executor that does not overlap) there is nothing to gather.
    pending = _pending_rows(seqs, starts, q_lens, input_ids) if any_pending else {}

    block_tables = torch.from_numpy(table)
    starts_t = torch.tensor(starts, dtype=torch.long)
    if num_tokens == num_seqs:  # decode only: one token per sequence, at position `start`
        seq_idx = torch.arange(num_seqs)
        positions = starts_t
    else:
        q_lens_t = torch.tensor(q_lens, dtype=torch.long)
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q_lens_t)
        first_row = torch.cumsum(q_lens_t, 0) - q_lens_t  # row of each sequence's 1st token
        positions = torch.arange(num_tokens) - first_row[seq_idx] + starts_t[seq_idx]
    slot_mapping = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
    query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)

    sample_seq_indices = [
        i
        for i, s in enumerate(seqs)
        # (forward-only callers, tests among them, pass no sampling params)
        if seq_lens[i] == len(s.token_ids)
        and not (s.sampling_params is not None and s.sampling_params.prompt_only)
    ]
    sample_rows = query_start_loc[1:].long()[sample_seq_indices] - 1
    for f in features:
        rows = f.sample_rows(seqs, sample_seq_indices, query_start_loc)
        if rows is not None:
            sample_seq_indices, sample_rows = rows

    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    ids = torch.tensor(input_ids, dtype=torch.long)
    tensors = (slot_mapping, block_tables, seq_lens_t, query_start_loc, ids, positions, sample_rows)
    if device.type != "cpu":  # (a CPU's model reads them where they are: no call per tensor)
        tensors = tuple(upload(t, device) for t in tensors)
    slot_mapping, block_tables, seq_lens_t, query_start_loc, ids, positions, sample_rows = tensors
    for launched, (rows_, src) in pending.items():
        # The tokens the host has not got yet, from the device's copy of the draws.
        ids[upload(torch.tensor(rows_), device)] = launched.device_tokens[
            upload(torch.tensor(src), launched.device_tokens.device)
        ].to(device)
    md = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens_t,
        query_start_loc=query_start_loc,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decode_seqs=sum(1 for n in q_lens if n == 1),
    )
    return BatchInputs(
        input_ids=ids,
        positions=positions,
        attn_metadata=md,
        sample_seq_indices=sample_seq_indices,
        sample_rows=sample_rows,
    )


def _pending_rows(
    seqs: list[ScheduledSequence], starts: list[int], q_lens: list[int], input_ids: list[int]
) -> dict[Any, tuple[list[int], list[int]]]:
    """For each launched step some of this step's input tokens come from: (the rows of the
    flattened batch, the rows of that step's draws). Only a row that read ``PENDING`` counts
    (a token the host filled before ``input_ids`` was read is used as it is)."""
    found: dict[Launched, tuple[list[int], list[int]]] = {}
    num_found = 0
    row = 0
    for s, a, n in zip(seqs, starts, q_lens, strict=True):
        p = s.pending
        if p is not None:
            launched, j, idx = p
            if a <= idx < a + n and input_ids[row + idx - a] == PENDING:
                rows_, src = found.setdefault(launched, ([], []))
                rows_.append(row + idx - a)
                src.append(j)
                num_found += 1
        row += n
    if input_ids.count(PENDING) != num_found:
        # Only the latest launched step's tokens may be missing (the servicer settles the
        # others first): anything else is a bug, and the step fails before it runs.
        raise RuntimeError("an input token of this step was sampled by an unsettled step")
    return found
