"""Mask rows on the wire (executor.proto TokenMask).

A row is ceil(vocab / 32) little-endian uint32 words, token t allowed iff bit t % 32 of word
t // 32 is set. Grammar masks are runs of all-ones or all-zeros words, so rows are sent zlib
compressed when that is smaller (it nearly always is: ~6 KiB raw for a 49k vocabulary).
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["allowed_ids", "decode_row", "encode_row", "num_words", "pack_ids"]

ZLIB_LEVEL = 1  # the fastest level already takes runs down to a few bytes each


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def encode_row(words: np.ndarray) -> tuple[bytes, bool]:
    """(payload, compressed) for one row of uint32 words."""
    raw = words.astype("<u4", copy=False).tobytes()
    packed = zlib.compress(raw, ZLIB_LEVEL)
    if len(packed) < len(raw):
        return packed, True
    return raw, False


def decode_row(payload: bytes, compressed: bool, vocab_size: int) -> np.ndarray:
    """The row's words; ValueError when it has the wrong size or is not valid zlib."""
    raw = zlib.decompress(payload) if compressed else payload
    if len(raw) != 4 * num_words(vocab_size):
        raise ValueError(
            f"mask row has {len(raw)} bytes, expected {4 * num_words(vocab_size)} "
            f"for a vocabulary of {vocab_size}"
        )
    return np.frombuffer(raw, dtype="<u4")


def pack_ids(token_ids: list[int], vocab_size: int) -> np.ndarray:
    """A row allowing exactly `token_ids` (tests and the benchmark build rows this way)."""
    bits = np.zeros(num_words(vocab_size) * 32, dtype=np.uint8)
    bits[list(token_ids)] = 1
    return np.packbits(bits, bitorder="little").view("<u4")


def allowed_ids(words: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids a row allows, ascending."""
    bits = np.unpackbits(words.astype("<u4", copy=False).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).tolist()
