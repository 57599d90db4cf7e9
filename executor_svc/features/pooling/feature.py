"""Embeddings as an executor feature: pooling parameters checked with a new sequence, the
prompt's hidden rows pooled after the forward (``pooling.py``), the vectors in the reply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executor_svc.features.base import Feature, InvalidStep, Step
from executor_svc.features.pooling.pooling import (
    FEATURE,
    PoolingState,
    check_pooling,
    pool_step,
    pooled_to_proto,
)

__all__ = ["Pooling"]


class Pooling(Feature):
    """Hooks: validate (``check_params``; ``check_new`` keeps a new sequence's PoolingState in
    its state's ``features``), after forward (MEAN rows kept, finished vectors to the caller's
    ``pooled`` list), record (``reply``)."""

    name = FEATURE
    output = "pooled"

    def check_params(self, field: str, params: Any, limits: Any) -> None:
        if not params.HasField("pooling"):
            return
        why = check_pooling(params.pooling, limits.hidden_size, f"{field}.pooling")
        if why is None and not params.prompt_only:
            why = f"{field}.pooling: only a prompt_only sequence can be pooled"
        if why is not None:
            raise InvalidStep(why)

    def check_new(self, field: str, n: Any, state: Any) -> None:
        if n.sampling_params.HasField("pooling"):
            if state.features is None:
                state.features = {}
            state.features[FEATURE] = PoolingState.from_proto(n.sampling_params.pooling)

    def active(self, seqs: Sequence[Any]) -> bool:
        # Inline rather than pooling_of: this runs over every step's sequences.
        return any(s.features and FEATURE in s.features for s in seqs)

    def after_forward(self, step: Step, hidden: Any) -> None:
        pooled = step.outputs.get(self.output)
        if pooled is not None:
            pooled.extend(pool_step(step.seqs, hidden))

    def reply(self, outputs: dict[str, list[Any]], response: Any) -> None:
        if outputs.get(self.output):
            response.pooled.extend(pooled_to_proto(outputs[self.output]))
