"""One grammar matcher per constrained sequence, and each step's masks.

A matcher's state is a function of the sequence's output tokens only, so it is advanced lazily:
before a mask is computed the matcher consumes whatever outputs it has not seen. That one rule
covers the steady state (one token a step), n > 1 (a forked sibling starts from the prompt and
replays nothing), preemption (the tokens are unchanged) and recovery after a scheduler crash (a
fresh Sequence with its stored outputs replays them all), and never needs a hook where tokens
are appended.

A sequence ends with reason "stop" as soon as its grammar is complete (`is_done`, checked by
the engine after each token), without a step to sample the EOS that the mask would then force;
a recovery that finds the completing token stored without its finish ends it the same way
(engine/recovery.py). Should anything still get past that, the mask allows only EOS and the
ordinary EOS check ends it (one token more than an undisturbed run). EOS is allowed only where the grammar accepts; max_tokens still cuts (the
output may then be incomplete, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np
import structlog

from scheduler_svc.core.request import Sequence
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.features.structured.bitmask import encode_rows, pack_ids
from scheduler_svc.features.structured.compiler import GrammarCompiler

__all__ = ["SeqMatchers", "StepMasks"]

log = structlog.get_logger(__name__)

MASK_THREADS = 2  # llguidance computes a step's masks in parallel, without the GIL


@dataclass(slots=True)
class StepMasks:
    """executor.proto TokenMasks as plain data."""

    seq_ids: list[str]
    row_index: list[int]  # seq_ids[i]'s row in `rows`
    rows: bytes  # the distinct rows, one zlib stream


@dataclass(slots=True, eq=False)
class _SeqMatcher:
    seq: Sequence  # the sequence object it follows; another object (recovery) starts over
    matcher: llguidance.LLMatcher
    num_consumed: int = 0  # output tokens consumed


class SeqMatchers:
    """The engine's matchers, by seq_id. Only the engine's loop calls it (one thread)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._by_seq: dict[str, _SeqMatcher] = {}
        self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        self._rows = np.zeros((0, 0), dtype=np.int32)
        self.num_masks = 0  # rows computed, for metrics
        self.num_mask_bytes = 0  # their bytes on the wire

    def __len__(self) -> int:
        return len(self._by_seq)

    def matcher_for(self, seq: Sequence, spec: dict[str, Any]) -> llguidance.LLMatcher:
        """The sequence's matcher, having consumed every output token so far."""
        state = self._by_seq.get(seq.seq_id)
        outputs = seq.num_output_tokens
        if state is None or state.seq is not seq or state.num_consumed > outputs:
            state = _SeqMatcher(seq, self.compiler.matcher(spec))
            self._by_seq[seq.seq_id] = state
        if state.num_consumed < outputs:
            tokens = seq.token_ids[seq.num_prompt_tokens + state.num_consumed :]
            if not state.matcher.consume_tokens(tokens):
                log.warning(
                    "grammar.token_rejected",
                    seq_id=seq.seq_id,
                    error=state.matcher.get_error(),
                )
            state.num_consumed = outputs
        return state.matcher

    def is_done(self, seq: Sequence, spec: dict[str, Any]) -> bool:
        """Whether the grammar is complete after the sequence's outputs (an errored matcher
        counts as done: its mask would allow only EOS anyway)."""
        return self.matcher_for(seq, spec).is_stopped()

    def step_masks(
        self, out: SchedulerOutput, spec_of: Callable[[str], dict[str, Any] | None]
    ) -> StepMasks | None:
        """Masks of the step's constrained sequences that sample; `spec_of(req_id)` is the
        request's structured_output (None: unconstrained)."""
        todo: list[tuple[str, llguidance.LLMatcher]] = []
        for seq, num in out.scheduled:
            if seq.prompt_only or seq.num_computed_tokens + num != len(seq.token_ids):
                continue  # a prefill chunk that samples nothing
            spec = spec_of(seq.req_id)
            if spec is not None:
                todo.append((seq.seq_id, self.matcher_for(seq, spec)))
        if not todo:
            return None
        vocab = self.compiler.vocab_size
        shape = llnp.get_bitmask_shape(len(todo), vocab)
        if self._rows.shape[0] < shape[0] or self._rows.shape[1] != shape[1]:
            self._rows = np.zeros((max(shape[0], 2 * self._rows.shape[0]), shape[1]), np.int32)
        rows = self._rows[: shape[0]]
        llnp.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, (_, m) in enumerate(todo)], rows
        )
        for i, (_, matcher) in enumerate(todo):
            if matcher.is_error() or not rows[i].any():
                # A token the mask forbade was sampled (it cannot happen while the executor
                # honours masks): end the sequence rather than sample from nothing.
                rows[i] = pack_ids(self.compiler.eos_token_ids or [0], vocab).view(np.int32)
        index, payload = encode_rows(rows.view(np.uint32))
        self.num_masks += len(todo)
        self.num_mask_bytes += len(payload)
        return StepMasks([seq_id for seq_id, _ in todo], index, payload)

    def sweep(self, is_live: Callable[[str], bool]) -> None:
        """Drop the matchers of sequences that finished, or whose request is gone."""
        for seq_id, state in list(self._by_seq.items()):
            if state.seq.is_finished or not is_live(state.seq.req_id):
                del self._by_seq[seq_id]
