"""Allowed-token masks of constrained sequences (structured output), applied to the logits.

The scheduler owns the grammar and sends, for the constrained sequences that sample, packed
bitmask rows (executor.proto TokenMasks: ceil(vocab / 32) little-endian uint32 words per row,
token t allowed iff bit t % 32 of word t // 32 is set; distinct rows once, as one zlib stream).
The runner sets every forbidden logit to -inf before the sampler sees the row, so greedy,
seeded sampling, penalties and the reported logprobs (as in vLLM) all work on the masked
distribution.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["apply_token_masks", "decode_masks", "unpack_rows"]


def decode_masks(
    seq_ids: Sequence[str], row_index: Sequence[int], rows: bytes, vocab_size: int
) -> dict[str, np.ndarray]:
    """seq_id -> its row of uint32 words; ValueError naming what is malformed."""
    if len(row_index) != len(seq_ids):
        raise ValueError(f"row_index has {len(row_index)} entries for {len(seq_ids)} sequences")
    if not seq_ids:
        return {}
    try:
        raw = zlib.decompress(rows)
    except zlib.error as e:
        raise ValueError(f"rows are not valid zlib data: {e}") from None
    width = 4 * ((vocab_size + 31) // 32)
    if not raw or len(raw) % width:
        raise ValueError(
            f"rows hold {len(raw)} bytes, not whole {width}-byte rows (vocab_size {vocab_size})"
        )
    table = np.frombuffer(raw, dtype="<u4").reshape(-1, width // 4)
    if bad := [i for i in row_index if i >= len(table)]:
        raise ValueError(f"row_index {bad[0]} is past the {len(table)} rows sent")
    if not unpack_rows(list(table), vocab_size).any(axis=1).all():
        raise ValueError("a row allows no token")
    return {s: table[i] for s, i in zip(seq_ids, row_index, strict=True)}


def unpack_rows(rows: Sequence[np.ndarray], vocab_size: int) -> np.ndarray:
    """[len(rows), vocab_size] bool from packed rows."""
    packed = np.stack([r.view(np.uint8) for r in rows])  # [n, 4 * num_words]
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size].astype(bool)


def apply_token_masks(
    logits: torch.Tensor,  # [num_rows, vocab] float32, written in place
    rows: list[int],
    masks: list[np.ndarray],
) -> None:
    """Forbidden tokens of logits[rows[i]] become -inf, per masks[i]."""
    if not rows:
        return
    vocab, device = logits.shape[1], logits.device
    # The packed words travel to the device (1 bit a token) and are unpacked there.
    words = torch.from_numpy(np.stack(masks).view(np.int32)).to(device)  # [k, num_words]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [k, num_words, 32]; bit t % 32 of word t // 32
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool()  # [k, vocab]
    idx = torch.tensor(rows, device=device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
