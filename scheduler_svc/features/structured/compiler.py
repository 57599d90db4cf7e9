"""Grammar compilation with llguidance, cached by (tokenizer, spec) with a bound.

llguidance compiles a grammar when a matcher is built from it (lazily, per lexer state), so the
cache keeps one pristine matcher per spec and hands out deep copies: a copy shares nothing
mutable and costs microseconds, where compiling a large schema costs milliseconds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from scheduler_svc.core.sampling_params import ValidationError
from scheduler_svc.features.structured.spec import check_spec, grammar_text, spec_key

__all__ = ["GrammarCompiler"]

DEFAULT_CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer. Thread-safe (the engine validates
    new requests off the event loop)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None  # built on first use (~1 s for 50k)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for metrics and tests

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                eos = self.eos_token_ids or None
                self._ll = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=eos
                )
            return self._ll

    def matcher(self, spec: dict[str, Any]) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the spec's grammar; ValidationError (with the
        library's message) when the spec is bad."""
        key = spec_key(spec)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        check_spec(spec)
        text = grammar_text(spec)
        template = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if template.is_error():
            kind = next(iter(spec))
            raise ValidationError(f"params.structured_output.{kind}: {template.get_error()}")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return template.deep_copy()

    def validate(self, spec: dict[str, Any]) -> None:
        """Raise ValidationError when the spec does not compile (and cache it when it does)."""
        self.matcher(spec)
