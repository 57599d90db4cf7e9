"""A step's mask rows on the wire (executor.proto TokenMasks).

A row is ceil(vocab / 32) little-endian uint32 words, token t allowed iff bit t % 32 of word
t // 32 is set. Sequences in the same grammar state (one schema, same place) have equal rows,
so a step sends each distinct row once, plus an index per sequence; the distinct rows go as one
zlib stream, since grammar masks are runs of all-ones or all-zeros words.
"""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["allowed_ids", "decode_rows", "encode_rows", "num_words", "pack_ids"]

ZLIB_LEVEL = 1  # the fastest level already takes runs down to a few bytes each


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def encode_rows(rows: np.ndarray) -> tuple[list[int], bytes]:
    """(row_index per input row, zlib stream of the distinct rows) for [n, words] uint32."""
    index: list[int] = []
    distinct: dict[bytes, int] = {}
    for row in rows.astype("<u4", copy=False):
        key = row.tobytes()
        index.append(distinct.setdefault(key, len(distinct)))
    return index, zlib.compress(b"".join(distinct), ZLIB_LEVEL)


def decode_rows(payload: bytes, vocab_size: int) -> np.ndarray:
    """[num_distinct, words] uint32; ValueError when the stream is not whole rows of valid
    zlib."""
    try:
        raw = zlib.decompress(payload)
    except zlib.error as e:
        raise ValueError(f"rows are not valid zlib data: {e}") from None
    width = 4 * num_words(vocab_size)
    if not raw or len(raw) % width:
        raise ValueError(
            f"rows hold {len(raw)} bytes, not a whole number of {width}-byte rows "
            f"(vocab_size {vocab_size})"
        )
    return np.frombuffer(raw, dtype="<u4").reshape(-1, width // 4)


def pack_ids(token_ids: list[int], vocab_size: int) -> np.ndarray:
    """A row allowing exactly `token_ids`."""
    bits = np.zeros(num_words(vocab_size) * 32, dtype=np.uint8)
    bits[list(token_ids)] = 1
    return np.packbits(bits, bitorder="little").view("<u4")


def allowed_ids(words: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids a row allows, ascending."""
    bits = np.unpackbits(words.astype("<u4", copy=False).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).tolist()
