"""The engine's one seam for structured outputs: validate a new request's constraint, add a
step's masks to its ExecuteModelRequest, forget a finished request's matchers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from protos import executor_pb2 as epb
from scheduler_svc.core.request import Sequence
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.grammar.compiler import GrammarCompiler
from scheduler_svc.grammar.matchers import SeqMatchers

__all__ = ["StructuredOutputs"]


class _HasParams(Protocol):
    params: SamplingParams
    n: int


class StructuredOutputs:
    """Owns the grammar compiler and the matchers; reads request parameters from `requests`
    (the engine's table of active requests), never changes them."""

    def __init__(self, requests: Mapping[str, _HasParams]) -> None:
        self._requests = requests
        self.matchers: SeqMatchers | None = None  # once the tokenizer is known (start)

    def start(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        if self.matchers is None:
            self.matchers = SeqMatchers(GrammarCompiler(tokenizer, vocab_size, eos_token_ids))

    async def validate(self, params: SamplingParams) -> None:
        """ValidationError (the library's message) when the constraint does not compile."""
        if params.structured_output is not None:
            assert self.matchers is not None, "validate() before start()"
            await asyncio.to_thread(self.matchers.compiler.validate, params.structured_output)

    def add_masks(self, msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
        """Masks for the step's constrained sequences that sample (none for most steps)."""
        if self.matchers is None:
            return
        masks = self.matchers.step_masks(out, self._spec_of)
        if masks is not None:
            # Positions in the step: new sequences, then cached ones, then the decode lane.
            order = [s.seq_id for s in out.new_seqs]
            order += [c.seq_id for c in out.cached_seqs]
            position = {seq_id: i for i, seq_id in enumerate(order)}
            base = len(order)
            position.update((seq_id, base + i) for i, seq_id in enumerate(out.decode_seq_ids))
            tm = msg.token_masks
            tm.seq_positions.extend([position[seq_id] for seq_id in masks.seq_ids])
            tm.row_index.extend(masks.row_index)
            tm.rows = masks.rows

    def grammar_done(self, seq: Sequence, spec: dict[str, Any]) -> bool:
        """The sequence's grammar is complete: nothing but EOS may follow."""
        return self.matchers is not None and self.matchers.is_done(seq, spec)

    def forget(self, req_id: str) -> None:
        handle = self._requests.get(req_id)
        if (
            self.matchers is not None
            and handle is not None
            and handle.params.structured_output is not None
        ):
            self.matchers.forget(req_id, handle.n)

    def _spec_of(self, req_id: str) -> dict[str, Any] | None:
        handle = self._requests.get(req_id)
        return handle.params.structured_output if handle is not None else None
