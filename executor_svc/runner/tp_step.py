"""One engine step as rank 0 sends it to the other ranks.

Rank 0 validates the ``ExecuteModel`` request and flattens the batch as it does without tensor
parallelism; what the other ranks need of it is the flattened batch (token ids, positions,
attention metadata, the rows that sample) and the step's cache operations. Workers keep no
per-sequence state, so they cannot drift from rank 0 and a rolled-back step needs nothing from
them.

On the wire a step is two broadcasts over the gloo group: a fixed header of counts, then one
int64 payload holding every list back to back (its size grows with the batch, plus the block
tables of the sequences in it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.parallel.group import TPGroup
from executor_svc.runner.batch import BatchInputs

OP_SHUTDOWN = 0
OP_STEP = 1
# op, num_tokens, num_seqs, max_num_blocks, num_samples, num_swap_out, num_swap_in, num_copy,
# num_logit_ranges, max_query_len, max_seq_len, num_decode_seqs, num_feature_bytes
HEADER_LEN = 13

BlockPairs = list[tuple[int, int]]


@dataclass(slots=True)
class StepMessage:
    blocks_to_swap_out: BlockPairs
    blocks_to_swap_in: BlockPairs
    blocks_to_copy: BlockPairs
    batch: BatchInputs | None  # None: a step with cache operations only
    # Row ranges of the hidden states rank 0 sends through the LM head for prompt logprobs,
    # in its order (each one is a collective every rank must join).
    logit_row_ranges: list[tuple[int, int]] = field(default_factory=list)
    # What features send the other ranks for the step (their ``to_workers`` hook), by feature
    # name, JSON-able; sent as JSON bytes, given to their ``worker_before_forward``.
    feature_data: dict[str, Any] = field(default_factory=dict)


def _pairs(pairs: BlockPairs) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.long).view(-1)


def send_step(tp: TPGroup, msg: StepMessage) -> None:
    """Rank 0: broadcast one step (the batch's tensors must be on the host)."""
    header = [OP_STEP, 0, 0, 0, 0]
    parts: list[torch.Tensor] = []
    b = msg.batch
    if b is not None:
        md = b.attn_metadata
        num_seqs, max_blocks = md.block_tables.shape
        header[1:5] = [b.input_ids.shape[0], num_seqs, max_blocks, b.sample_rows.shape[0]]
        parts += [b.input_ids, b.positions, md.slot_mapping, md.block_tables.view(-1)]
        parts += [md.seq_lens, md.query_start_loc, b.sample_rows]
    header += [len(msg.blocks_to_swap_out), len(msg.blocks_to_swap_in), len(msg.blocks_to_copy)]
    header.append(len(msg.logit_row_ranges))
    header += [md.max_query_len, md.max_seq_len, md.num_decode_seqs] if b is not None else [0] * 3
    data = json.dumps(msg.feature_data).encode() if msg.feature_data else b""
    header.append(len(data))
    parts += [_pairs(p) for p in (msg.blocks_to_swap_out, msg.blocks_to_swap_in)]
    parts += [_pairs(msg.blocks_to_copy), _pairs(msg.logit_row_ranges)]
    if data:
        parts.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    payload = torch.cat([p.to(torch.long) for p in parts])
    tp.broadcast_host(torch.tensor([*header, payload.shape[0]], dtype=torch.long))
    tp.broadcast_host(payload)


def send_shutdown(tp: TPGroup) -> None:
    tp.broadcast_host(torch.tensor([OP_SHUTDOWN] + [0] * HEADER_LEN, dtype=torch.long))


def recv_step(tp: TPGroup) -> StepMessage | None:
    """Workers: the next step rank 0 sends (blocks until it comes); None means shut down."""
    header_t = torch.empty(HEADER_LEN + 1, dtype=torch.long)
    tp.broadcast_host(header_t)
    header = header_t.tolist()
    if header[0] == OP_SHUTDOWN:
        return None
    assert header[0] == OP_STEP, header
    (_, num_tokens, num_seqs, max_blocks, num_samples, n_out, n_in, n_copy, n_ranges) = header[:9]
    max_query_len, max_seq_len, num_decode_seqs, num_feature_bytes, size = header[9:]
    payload = torch.empty(size, dtype=torch.long)
    tp.broadcast_host(payload)
    sizes = [num_tokens] * 3 + [num_seqs * max_blocks, num_seqs]
    sizes += [num_seqs + 1 if num_seqs else 0, num_samples]
    sizes += [2 * n_out, 2 * n_in, 2 * n_copy, 2 * n_ranges, num_feature_bytes]
    (ids, pos, slots, tables, seq_lens, qsl, rows, out, into, copy, ranges, data) = payload.split(
        sizes
    )
    feature_data = {}
    if num_feature_bytes:
        feature_data = json.loads(bytes(data.to(torch.uint8).tolist()).decode())
    batch = None
    if num_seqs:
        md = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            query_start_loc=qsl.to(torch.int32),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_decode_seqs=num_decode_seqs,
        )
        # Which sequences sample is rank 0's business; workers only need the rows.
        batch = BatchInputs(ids, pos, md, sample_seq_indices=[], sample_rows=rows)
    return StepMessage(
        _unpairs(out),
        _unpairs(into),
        _unpairs(copy),
        batch,
        [tuple(p) for p in _unpairs(ranges)],
        feature_data,
    )


def _unpairs(t: torch.Tensor) -> BlockPairs:
    flat = t.tolist()
    return list(zip(flat[0::2], flat[1::2], strict=True))
