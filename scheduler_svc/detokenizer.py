"""Incremental detokenization: token ids in, only new complete text out.

Decoding the whole output after every token costs O(n) per token. Instead each step decodes a
small window of ids: `ids[prefix:read]` (tokens whose text was already emitted, kept only as
context) and `ids[prefix:]` (the same plus the pending tokens). The new text is the second
decode minus the first. The context matters for spacing: SentencePiece-style decoders strip the
leading space of the first token they see, and a decode that starts one token earlier keeps it.

Byte-level tokens can end in the middle of a UTF-8 character, which decodes to a trailing
U+FFFD. Such a tail is held back (and the window not advanced) until a later token completes it;
`flush()` releases whatever is left when the sequence ends.
"""

from __future__ import annotations

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
        self._chunks: list[str] = []
        self._num_chars = 0
        self._token_text = _token_text_caches.setdefault(tokenizer, {})

    @property
    def text(self) -> str:
        """The whole output text emitted so far."""
        # Joined lazily: the engine streams deltas and rarely needs the whole text.
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def num_chars(self) -> int:
        """len(self.text), without joining."""
        return self._num_chars

    def add(self, token_ids: Iterable[int]) -> str:
        """Append output tokens; return the text that became complete with them."""
        pieces = []
        for token_id in token_ids:
            if token_id in self._skipped_ids:
                continue
            self._ids.append(token_id)
            piece = self._step(final=False)
            if piece:
                pieces.append(piece)
        return self._emit("".join(pieces))

    def flush(self) -> str:
        """Release held-back text (an incomplete character decodes to U+FFFD) at the end."""
        return self._emit(self._step(final=True))

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

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._num_chars += len(text)
        return text
