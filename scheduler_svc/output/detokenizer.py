"""Incremental detokenization: token ids in, only new complete text out.

Decoding the whole output after every token costs O(n) per token. Instead each step decodes a
small window of ids: `ids[prefix:read]` (tokens whose text was already emitted, kept only as
context) and `ids[prefix:]` (the same plus the pending tokens). The new text is the second
decode minus the first. The context matters for spacing: SentencePiece-style decoders strip the
leading space of the first token they see, and a decode that starts one token earlier keeps it.

Byte-level tokens can end in the middle of a UTF-8 character, which decodes to a trailing
U+FFFD. Such a tail is held back (and the window not advanced) until a later token completes it;
`flush()` releases whatever is left when the sequence ends.

Fast path: when the tokenizer's decoder is byte-level (GPT-2, Llama 3, Qwen, SmolLM and the demo
model), decoding is plain concatenation of each token's bytes followed by a lossy UTF-8 decode.
Then no window is needed: a table of token bytes (built and checked against the real decoder once
per tokenizer) feeds Python's incremental UTF-8 decoder, which holds an incomplete character
back by itself. That is a dict-free list lookup and one C call per token instead of a decode
call into the tokenizer. Other decoders (SentencePiece-style byte fallback groups invalid bytes
differently) keep the window algorithm.
"""

from __future__ import annotations

import codecs
import json
import random
import weakref
from collections.abc import Iterable, Sequence

from transformers import PreTrainedTokenizerFast

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first output token (spacing of the first word).
_NUM_PROMPT_CONTEXT_TOKENS = 5
# A character is at most 4 bytes, so valid text never keeps this many tokens pending; only a
# run of invalid bytes does, and then the window is forced forward to keep each step O(1).
_MAX_PENDING_TOKENS = 32
# Drop ids that fell out of the window once this many pile up (keeps memory bounded).
_COMPACT_AT = 1024

# Text of single tokens, shared by every sequence of a tokenizer: after each emission the context
# window is usually one token, so its decode becomes a dict lookup (at most vocab-size entries).
_token_text_caches: weakref.WeakKeyDictionary[PreTrainedTokenizerFast, dict[int, str]] = (
    weakref.WeakKeyDictionary()
)
# Byte tables of byte-level tokenizers (None: this tokenizer needs the window algorithm).
_byte_tables: weakref.WeakKeyDictionary[PreTrainedTokenizerFast, list[bytes] | None] = (
    weakref.WeakKeyDictionary()
)
_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte is shown as a printable character.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    assigned the code points from U+0100 upwards, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(0x100 + extra)] = b
            extra += 1
    return chars


def token_byte_table(tokenizer: PreTrainedTokenizerFast) -> list[bytes] | None:
    """Bytes of every token id if `tokenizer` decodes by concatenating token bytes, else None.

    Only a plain byte-level decoder qualifies, and the table is checked against the tokenizer's
    own decode on random id sequences (special tokens included) before it is trusted.
    """
    if tokenizer in _byte_tables:
        return _byte_tables[tokenizer]
    backend = tokenizer.backend_tokenizer
    table = None
    if (json.loads(backend.to_str()).get("decoder") or {}).get("type") == "ByteLevel":
        table = _build_byte_table(backend)
    _byte_tables[tokenizer] = table
    return table


def _build_byte_table(backend) -> list[bytes] | None:
    alphabet = _byte_level_alphabet()
    vocab = backend.get_vocab(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        if i in added:
            # Added tokens are whole strings; the decoder shows their text.
            table[i] = backend.decode([i], skip_special_tokens=False).encode()
            continue
        try:
            table[i] = bytes(alphabet[c] for c in token)
        except KeyError:
            table[i] = token.encode()  # a character outside the alphabet stands for itself
    # Trust it only if it reproduces the real decoder: every token alone (a token holding part
    # of a character decodes to U+FFFD both ways), then random runs of tokens, where bytes join
    # up across tokens and invalid sequences occur.
    ids = list(vocab.values())
    singles = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    for i, text in zip(ids, singles, strict=True):
        if table[i].decode("utf-8", "replace") != text:
            return None
    rng = random.Random(0)
    samples = [list(added)] if added else []
    samples += [[rng.choice(ids) for _ in range(rng.randint(1, 8))] for _ in range(300)]
    expected = backend.decode_batch(samples, skip_special_tokens=False)
    for sample, text in zip(samples, expected, strict=True):
        if b"".join(table[i] for i in sample).decode("utf-8", "replace") != text:
            return None
    return table


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, a few tokens at a time."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        backend = tokenizer.backend_tokenizer
        self._decode = backend.decode
        # Skipped special tokens are dropped before they enter the window: the backend would drop
        # them before decoding anyway, and a long run of them (ignore_eos) must not grow it.
        self._skipped_ids: frozenset[int] = (
            frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
            if skip_special_tokens
            else frozenset()
        )
        context = [t for t in prompt_token_ids if t not in self._skipped_ids]
        self._ids: list[int] = context[-_NUM_PROMPT_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode of ids[prefix:read], computed lazily
        self._num_emitted = 0  # chars of the current window's new text already returned
        self._token_text = _token_text_caches.setdefault(tokenizer, {})
        # Fast path (see the module docstring): token bytes into an incremental UTF-8 decoder.
        self._table = token_byte_table(tokenizer)
        self._utf8 = None
        if self._table is not None:
            utf8 = _Utf8Decoder("replace")
            # The context's bytes go in first; if they end inside a character, the window
            # algorithm is used instead, so both paths agree on where the output starts.
            utf8.decode(b"".join(self._table_bytes(t) for t in self._ids))
            if not utf8.getstate()[0]:
                self._utf8 = utf8.decode

    def _table_bytes(self, token_id: int) -> bytes:
        table = self._table
        return table[token_id] if 0 <= token_id < len(table) else b""

    def add_one(self, token_id: int) -> str:
        """`add([token_id])`, cheaper: the per-step call of the engine."""
        if self._utf8 is None:
            return self.add((token_id,))
        if token_id in self._skipped_ids:
            return ""
        table = self._table
        # Ids past the tokenizer's vocabulary (a model's padded embedding) decode to nothing.
        return self._utf8(table[token_id] if token_id < len(table) else b"")

    def add(self, token_ids: Iterable[int]) -> str:
        """Append output tokens; return the text that became complete with them."""
        if self._utf8 is not None:
            return "".join([self.add_one(t) for t in token_ids])
        pieces = []
        for token_id in token_ids:
            if token_id in self._skipped_ids:
                continue
            self._ids.append(token_id)
            piece = self._step(final=False)
            if piece:
                pieces.append(piece)
        return "".join(pieces)

    def flush(self) -> str:
        """Release held-back text (an incomplete character decodes to U+FFFD) at the end."""
        if self._utf8 is not None:
            return self._utf8(b"", True)
        return self._step(final=True)

    def decode_token(self, token_id: int) -> str:
        """Text of one token on its own, special tokens included (for logprob alternatives).

        A token holding part of a multi-byte character decodes to U+FFFD.
        """
        text = self._token_text.get(token_id)
        if text is None:
            text = self._decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def _step(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            if self._read_offset - self._prefix_offset == 1:
                # Skipped ids never enter the window, so the unskipped single-token text is it.
                self._prefix_text = self.decode_token(self._ids[self._prefix_offset])
            else:
                self._prefix_text = self._decode(
                    self._ids[self._prefix_offset : self._read_offset],
                    skip_special_tokens=self.skip_special_tokens,
                )
        full = self._decode(
            self._ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens
        )
        start = len(self._prefix_text) + self._num_emitted
        pending = len(self._ids) - self._read_offset
        if full.endswith(_REPLACEMENT) and not final and pending < _MAX_PENDING_TOKENS:
            # Appending bytes only changes the undecodable tail, so the text before the trailing
            # U+FFFD run is final and can go out now; the window stays put until the tail is
            # resolved.
            end = len(full.rstrip(_REPLACEMENT))
            if end <= start:
                return ""
            self._num_emitted += end - start
            return full[start:end]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        self._num_emitted = 0
        if self._prefix_offset >= _COMPACT_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full[start:]
