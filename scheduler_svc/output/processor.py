"""Per-sequence output handling: stop conditions, streamed text deltas, logprobs.

Each sampled token goes through the stop checks in vLLM's order:

1. min_tokens: while the output is shorter than min_tokens, EOS, stop token ids and stop strings
   do not end the sequence (the token is kept as ordinary output).
2. EOS (unless ignore_eos) -> FINISHED_STOPPED, stop_reason None; its text is never included.
3. stop_token_ids -> FINISHED_STOPPED, stop_reason = the id; its text only with
   include_stop_str_in_output (and only if skip_special_tokens does not drop it anyway).
4. stop strings -> FINISHED_STOPPED, stop_reason = the string; the text ends before the match
   (or after it with include_stop_str_in_output). Only matches that end in the newly decoded
   text are considered, so a match that min_tokens suppressed never fires later.
5. max_tokens -> FINISHED_LENGTH.
6. max model length (prompt + output tokens >= max_model_len) -> FINISHED_LENGTH.

A stop string may complete over several tokens, so trailing text that could still be the start
of one is held back from the stream until it cannot (or the sequence finishes). With
include_stop_str_in_output nothing needs holding back: a match keeps its own text.

The state after a token depends only on the tokens so far, never on how they were grouped into
calls; that is what makes `output_token_ids=` replay (resume after a restart) exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerFast

from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.output.detokenizer import IncrementalDetokenizer

__all__ = [
    "OutputDelta",
    "SequenceOutputState",
    "TokenAlternative",
    "TokenLogprob",
]


@dataclass(slots=True)
class TokenAlternative:
    token_id: int
    logprob: float
    text: str  # the token decoded on its own


@dataclass(slots=True)
class TokenLogprob:
    token_id: int  # the sampled token
    logprob: float
    top: list[TokenAlternative]  # most likely first, at most params.logprobs entries


@dataclass(slots=True)
class OutputDelta:
    """What one call added to a sequence's output; maps onto one GenerateResponse."""

    text: str  # new complete text (stop-string candidates held back until resolved)
    token_ids: list[int]  # new output tokens, up to and including the one that finished it
    token_offset: int  # index of token_ids[0] in the output
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when requested
    finish_status: RequestStatus | None = None
    stop_reason: int | str | None = None  # stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_status is not None


class SequenceOutputState:
    """Output bookkeeping of one sequence: tokens, text, stream position, finish status."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        *,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        output_token_ids: Sequence[int] = (),
        num_streamed_chars: int | None = None,
    ) -> None:
        """Start a sequence's output, or resume one.

        `output_token_ids` are tokens already produced (e.g. loaded from the store): they are
        replayed through the same checks without being returned, so the next `append` continues
        exactly where an uninterrupted run would. `num_streamed_chars` overrides how much of
        their text counts as already sent (default: what an uninterrupted run had streamed).
        """
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_model_len = max_model_len
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self._eos_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = [s for s in params.stop if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # Cheap rejections (set.isdisjoint runs in C): a match ending in new text needs a stop
        # string's last character there, and held-back text starts with a first character.
        self._stop_last_chars = frozenset(s[-1] for s in self._stops)
        self._stop_first_chars = frozenset(s[0] for s in self._stops)
        self._hold_back = bool(self._stops) and not params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Tokens that may end the sequence by id; any other token, with no stop strings set,
        # takes append_token's short path.
        self._stop_or_eos = self._eos_ids | self._stop_ids
        self._decode_one = self.detokenizer.add_one
        # The output may grow to the smaller of max_tokens and what max model length leaves.
        self._max_output = min(params.max_tokens, max_model_len - self.num_prompt_tokens)
        self.output_token_ids: list[int] = []
        self.finish_status: RequestStatus | None = None
        self.stop_reason: int | str | None = None
        # The text is kept in parts and joined only when read: `str +=` on an attribute copies
        # the whole string, O(n) per token. Stop handling only ever looks at the end of it.
        self._parts: list[str] = []
        self._num_chars = 0
        self._tail = ""  # last max(len(stop)) - 1 chars: where a stop string can begin
        self._pending = ""  # suffix of the text not yet handed out in a delta
        for token_id in output_token_ids:
            finished = self._append_one(token_id)
            self._take_stream_text()  # what an uninterrupted run had sent; keeps _pending short
            if finished:
                break
        if num_streamed_chars is not None:
            start = max(0, min(num_streamed_chars, self._num_chars))
            self._pending = self.text[start:]

    @property
    def finished(self) -> bool:
        return self.finish_status is not None

    @property
    def text(self) -> str:
        """Output text so far; final (cut at a stop string) once finished."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def num_streamed_chars(self) -> int:
        """Length of the text prefix already handed out in deltas."""
        return self._num_chars - len(self._pending)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
    ) -> OutputDelta:
        """Add newly sampled tokens (one per step, or several) and return the delta.

        `logprobs[i]` / `top_logprobs[i]` belong to `token_ids[i]`; they are needed only when
        params.logprobs is set. Tokens after the one that finishes the sequence are dropped.
        """
        if self.finished:
            raise RuntimeError(f"sequence already finished ({self.finish_status.name})")
        want_logprobs = self.params.logprobs is not None
        if want_logprobs and (logprobs is None or len(logprobs) != len(token_ids)):
            raise ValueError("params.logprobs is set: pass one logprob per token")
        token_offset = len(self.output_token_ids)
        entries: list[TokenLogprob] = []
        num_kept = 0
        for i, token_id in enumerate(token_ids):
            num_kept += 1
            if want_logprobs:
                entries.append(self._logprob_entry(i, token_id, logprobs, top_logprobs))
            if self._append_one(token_id):
                break
        return OutputDelta(
            text=self._take_stream_text(),
            token_ids=list(token_ids[:num_kept]),
            token_offset=token_offset,
            logprobs=entries,
            finish_status=self.finish_status,
            stop_reason=self.stop_reason,
        )

    def finish(self, status: RequestStatus, stop_reason: int | str | None = None) -> OutputDelta:
        """End the sequence from outside (abort, error) and release any held-back text."""
        if not self.finished:
            self._finish(status, stop_reason)
        return OutputDelta(
            text=self._take_stream_text(),
            token_ids=[],
            token_offset=len(self.output_token_ids),
            finish_status=self.finish_status,
            stop_reason=self.stop_reason,
        )

    def append_token(self, token_id: int) -> str:
        """One sampled token without logprobs; returns only the delta's text.

        The engine's per-step call: `append([token_id]).text` without building a delta. Whether
        it finished the sequence is in `finish_status` / `stop_reason` afterwards.
        """
        if self.finish_status is not None:
            raise RuntimeError(f"sequence already finished ({self.finish_status.name})")
        if token_id in self._stop_or_eos:
            self._append_one(token_id)
            return self._take_stream_text()
        # Short paths, same result as _append_one: this id stops nothing by itself.
        output = self.output_token_ids
        output.append(token_id)
        text = self._decode_one(token_id)
        if self._stops:
            if text:
                # _add_text, inlined.
                tail = self._tail
                self._parts.append(text)
                self._num_chars += len(text)
                pending = self._pending + text if self._pending else text
                self._pending = pending
                if self._max_stop_len > 1:
                    self._tail = (tail + text)[1 - self._max_stop_len :]
                if (
                    len(output) >= self._min_tokens
                    and not self._stop_last_chars.isdisjoint(text)
                    and self._check_stop_strings(tail, text)
                ):
                    return self._take_stream_text()
            if len(output) >= self._max_output:
                self._finish(RequestStatus.FINISHED_LENGTH, None)
                return self._take_stream_text()
            pending = self._pending
            if not pending:
                return ""
            if self._hold_back and not self._stop_first_chars.isdisjoint(
                pending[1 - self._max_stop_len :] if self._max_stop_len > 1 else ""
            ):
                return self._take_stream_text()  # part of it may start a stop string
            self._pending = ""
            return pending
        # No stop strings: only the length limits are left, and no text is ever held back.
        if text:
            self._parts.append(text)
            self._num_chars += len(text)
        if self._pending:  # a resume's override of the streamed position, or flushed bytes
            text = self._pending + text
            self._pending = ""
        if len(output) >= self._max_output:
            self._finish(RequestStatus.FINISHED_LENGTH, None)
            text += self._pending
            self._pending = ""
        return text

    def _append_one(self, token_id: int) -> bool:
        """Apply one token and the stop checks; True when it finished the sequence."""
        output = self.output_token_ids
        output.append(token_id)
        num_output = len(output)
        if num_output >= self._min_tokens:
            if token_id in self._eos_ids:
                self._finish(RequestStatus.FINISHED_STOPPED, None)
                return True
            if token_id in self._stop_ids:
                if self.params.include_stop_str_in_output:
                    self._add_text(self.detokenizer.add_one(token_id))
                self._finish(RequestStatus.FINISHED_STOPPED, token_id)
                return True
            new_text = self.detokenizer.add_one(token_id)
            if new_text:
                tail = self._tail
                self._add_text(new_text)
                if (
                    self._stops
                    and not self._stop_last_chars.isdisjoint(new_text)
                    and self._check_stop_strings(tail, new_text)
                ):
                    return True
        else:
            self._add_text(self.detokenizer.add_one(token_id))
        if num_output >= self._max_output:
            # max_tokens, or prompt + output reached max model length.
            self._finish(RequestStatus.FINISHED_LENGTH, None)
            return True
        return False

    def _check_stop_strings(self, tail: str, new_text: str) -> bool:
        """Finish at the earliest stop string that ends in `new_text` (`tail` precedes it)."""
        window = tail + new_text
        best_pos, best_stop = -1, ""
        for stop in self._stops:
            # Starting here, any match ends inside new_text: one that lay wholly in older text
            # was either seen already or suppressed by min_tokens.
            pos = window.find(stop, max(0, len(tail) - len(stop) + 1))
            if pos != -1 and (best_pos == -1 or pos < best_pos):
                best_pos, best_stop = pos, stop
        if best_pos == -1:
            return False
        end = best_pos + len(best_stop) if self.params.include_stop_str_in_output else best_pos
        self._truncate(self._num_chars - len(window) + end)
        self.finish_status = RequestStatus.FINISHED_STOPPED
        self.stop_reason = best_stop
        return True

    def _finish(self, status: RequestStatus, stop_reason: int | str | None) -> None:
        # Bytes of an unfinished character are released as U+FFFD: nothing can complete them.
        self._add_text(self.detokenizer.flush())
        self.finish_status = status
        self.stop_reason = stop_reason

    def _add_text(self, text: str) -> None:
        if not text:
            return
        self._parts.append(text)
        self._num_chars += len(text)
        if self._pending:
            self._pending += text
        else:
            self._pending = text
        if self._max_stop_len > 1:
            self._tail = (self._tail + text)[-(self._max_stop_len - 1) :]

    def _truncate(self, num_chars: int) -> None:
        # Held-back text keeps every possible match start unstreamed, so the cut never lands
        # inside text a client already has (only a resume override of the position can).
        num_streamed = self.num_streamed_chars
        self._parts = [self.text[:num_chars]]
        self._num_chars = num_chars
        self._pending = self._pending[: max(0, num_chars - num_streamed)]

    def _take_stream_text(self) -> str:
        pending = self._pending
        if not pending:
            return ""
        end = len(pending) if self.finished or not self._hold_back else self._hold_start()
        self._pending = pending[end:]
        return pending[:end]

    def _hold_start(self) -> int:
        """Start, in `_pending`, of the longest suffix that begins some stop string."""
        text = self._pending
        n = len(text)
        lo = max(0, n - self._max_stop_len + 1)
        if self._stop_first_chars.isdisjoint(text[lo:]):
            return n  # no stop string can start in the tail: nothing to hold back
        best = n
        for stop in self._stops:
            first = stop[0]
            # A proper prefix of `stop` is shorter than it, so it starts at n - len(stop) + 1 or
            # later; candidates are positions holding stop[0].
            pos = text.find(first, max(lo, n - len(stop) + 1))
            while pos != -1 and pos < best:
                if stop.startswith(text[pos:]):
                    best = pos
                    break
                pos = text.find(first, pos + 1)
        return best

    def _logprob_entry(
        self,
        i: int,
        token_id: int,
        logprobs: Sequence[float] | None,
        top_logprobs: Sequence[Sequence[tuple[int, float]]] | None,
    ) -> TokenLogprob:
        assert logprobs is not None and self.params.logprobs is not None
        top = top_logprobs[i][: self.params.logprobs] if top_logprobs is not None else ()
        decode = self.detokenizer.decode_token
        return TokenLogprob(
            token_id=token_id,
            logprob=float(logprobs[i]),
            top=[TokenAlternative(t, float(lp), decode(t)) for t, lp in top],
        )
