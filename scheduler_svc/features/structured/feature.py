"""Structured outputs on the scheduler's hooks: check a constraint compiles (validate), add each
step's token masks (step message), and end a sequence whose grammar is complete (its taker)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protos import executor_pb2 as epb
from scheduler_svc.core.request import RequestStatus, Sequence
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.features.base import Feature, StepReply, Taker
from scheduler_svc.features.structured.structured import StructuredOutputs

__all__ = ["StructuredOutput"]


class StructuredOutput(Feature):
    name = "structured_output"

    def __init__(self, model: Any, requests: Mapping[str, Any]) -> None:
        self.outputs = StructuredOutputs(model, requests)  # grammars, token masks

    async def validate(self, inp: Any) -> None:
        await self.outputs.validate(inp.params)  # compiles the grammar (cached)

    def admit(self, handle: Any) -> None:
        if handle.params.structured_output is not None:
            handle.take = _constrained(self.outputs, handle.take)

    def step_message(self, msg: epb.ExecuteModelRequest, out: SchedulerOutput) -> None:
        self.outputs.add_masks(msg, out)

    def resumed(self, handle: Any, req: Any, record: Any) -> None:
        """A constrained sequence whose stored tokens already complete its grammar ends here
        with reason stop, as it did live in the step of its last token: only its finish, a
        separate write after the tokens, was lost. Recomputing it instead would sample the EOS
        its mask then forces: one token more than an undisturbed run."""
        spec = handle.params.structured_output
        if spec is None:
            return
        for seq in req.seqs:
            if not seq.is_finished and self.outputs.grammar_done(seq, spec):
                handle.finish_seq(seq.index, RequestStatus.FINISHED_STOPPED, None, record)
                seq.status = RequestStatus.FINISHED_STOPPED


def _constrained(outputs: StructuredOutputs, inner: Taker) -> Taker:
    """A constrained sequence whose grammar is complete ends with reason stop at once, without a
    step to sample the EOS its mask would now force."""

    def take(handle: Any, seq: Sequence, reply: StepReply) -> RequestStatus | None:
        status = inner(handle, seq, reply)
        if status is not None or not outputs.grammar_done(seq, handle.params.structured_output):
            return status
        handle.finish_seq(seq.index, RequestStatus.FINISHED_STOPPED, None, reply.record)
        return RequestStatus.FINISHED_STOPPED

    return take
