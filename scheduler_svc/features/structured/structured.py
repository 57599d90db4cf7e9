"""The engine's one seam for structured outputs: check a new request's constraint compiles, add
a step's masks to its ExecuteModelRequest, and say when a sequence's grammar is complete.

Handed the engine's model info (the tokenizer and limits, known once the first executor is
connected) and its table of active requests (read only, for each request's constraint)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from protos import executor_pb2 as epb
from scheduler_svc.core.request import Sequence
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.features.structured.compiler import GrammarCompiler
from scheduler_svc.features.structured.matchers import SeqMatchers

__all__ = ["StructuredOutputs"]

# Every this many steps, matchers of finished sequences are dropped (no hook where requests
# finish: a matcher is only memory, and one rebuilt later would replay to the same state).
SWEEP_EVERY_STEPS = 64


class _Model(Protocol):
    tokenizer: Any
    vocab_size: int
    eos_token_ids: list[int]


class _Request(Protocol):
    params: SamplingParams


class StructuredOutputs:
    def __init__(self, model: _Model, requests: Mapping[str, _Request]) -> None:
        self._model = model
        self._requests = requests
        self._matchers: SeqMatchers | None = None  # built on first use: the model is known
        self._num_steps = 0

    @property
    def matchers(self) -> SeqMatchers:
        if self._matchers is None:
            m = self._model
            assert m.tokenizer is not None, "structured outputs before the model is known"
            compiler = GrammarCompiler(m.tokenizer, m.vocab_size, m.eos_token_ids)
            self._matchers = SeqMatchers(compiler)
        return self._matchers

    async def validate(self, params: SamplingParams) -> None:
        """ValidationError (the library's message) when the constraint does not compile."""
        if params.structured_output is not None:
            compiler = self.matchers.compiler
            await asyncio.to_thread(compiler.validate, params.structured_output)

    def add_masks(self, msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
        """Masks for the step's constrained sequences that sample (none for most steps)."""
        self._num_steps += 1
        if self._matchers is not None and self._num_steps % SWEEP_EVERY_STEPS == 0:
            self._matchers.sweep(self._requests.__contains__)
        if self._matchers is None and not any(
            (h := self._requests.get(seq.req_id)) is not None
            and h.params.structured_output is not None
            for seq, _ in out.scheduled
        ):
            return  # no constrained request yet: do not build the tokenizer's tables
        masks = self.matchers.step_masks(out, self._spec_of)
        if masks is None:
            return
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
        return self.matchers.is_done(seq, spec)

    def _spec_of(self, req_id: str) -> dict[str, Any] | None:
        handle = self._requests.get(req_id)
        return handle.params.structured_output if handle is not None else None
