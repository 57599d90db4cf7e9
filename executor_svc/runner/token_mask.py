"""Allowed-token masks of constrained sequences (structured output), applied to the logits.

The scheduler owns the grammar and sends, for each constrained sequence that samples, a packed
bitmask (executor.proto TokenMask: ceil(vocab / 32) little-endian uint32 words, token t allowed
iff bit t % 32 of word t // 32 is set, optionally zlib-compressed). The runner sets every
forbidden logit to -inf before the sampler sees the row, so greedy, seeded sampling, penalties
and the reported logprobs (as in vLLM) all work on the masked distribution.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["apply_token_masks", "decode_mask", "unpack_rows"]


def decode_mask(payload: bytes, compressed: bool, vocab_size: int) -> np.ndarray:
    """One row as uint32 words; ValueError when it is malformed or allows nothing."""
    try:
        raw = zlib.decompress(payload) if compressed else payload
    except zlib.error as e:
        raise ValueError(f"bitmask is not valid zlib data: {e}") from None
    num_words = (vocab_size + 31) // 32
    if len(raw) != 4 * num_words:
        raise ValueError(
            f"bitmask has {len(raw)} bytes, expected {4 * num_words} (vocab_size {vocab_size})"
        )
    words = np.frombuffer(raw, dtype="<u4")
    if not unpack_rows([words], vocab_size).any():
        raise ValueError("bitmask allows no token")
    return words


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
    vocab = logits.shape[1]
    allowed = torch.from_numpy(unpack_rows(masks, vocab)).to(logits.device)  # [k, vocab]
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
