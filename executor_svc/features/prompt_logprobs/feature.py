"""Prompt logprobs (and echo) as an executor feature: the log-probability of each prompt token
from a step's prefill rows (``prompt_logprobs.py``), in the reply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executor_svc.features.base import Feature, LoadContext, Step
from executor_svc.features.prompt_logprobs.prompt_logprobs import (
    PromptLogprobResult,
    chunks,
    compute,
)
from protos import executor_pb2 as pb

__all__ = ["PromptLogprobs"]


class PromptLogprobs(Feature):
    """Hooks: after forward (LM-head passes over the prompt rows, before the sampling one: on
    tensor-parallel ranks each is a collective, in this order), prepare inputs (those passes'
    row ranges to the other ranks), record (``reply``)."""

    name = "prompt_logprobs"
    output = "prompt_logprobs"

    def __init__(self) -> None:
        self._model: Any = None

    def load(self, ctx: LoadContext) -> None:
        self._model = ctx.model

    def active(self, seqs: Sequence[Any]) -> bool:
        return any(
            s.sampling_params is not None and s.sampling_params.num_prompt_logprobs is not None
            for s in seqs
        )

    def to_workers(self, step: Step, fields: dict[str, Any]) -> None:
        if step.outputs.get(self.output) is not None:
            ranges = [(r, r + b - a) for _, _, a, b, r in chunks(step.seqs)]
            fields["logit_row_ranges"] = ranges

    def after_forward(self, step: Step, hidden: Any) -> None:
        out = step.outputs.get(self.output)
        if out is not None:
            out.extend(compute(self._model, step.seqs, hidden))

    def reply(self, outputs: dict[str, list[Any]], response: Any) -> None:
        results = outputs.get(self.output)
        if results:
            response.prompt_logprobs.extend(_to_pb(r) for r in results)


def _to_pb(r: PromptLogprobResult) -> pb.PromptLogprobs:
    return pb.PromptLogprobs(
        seq_id=r.seq_id,
        first_position=r.first_position,
        entries=[
            pb.PromptTokenLogprob(
                logprob=lp,
                top_logprobs=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in top],
            )
            for lp, top in zip(r.logprobs, r.top, strict=True)
        ],
    )
