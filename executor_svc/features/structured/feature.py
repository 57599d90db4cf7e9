"""Structured outputs on the executor: the step's allowed-token masks (``token_mask.py``) checked
with the request and applied to the logits of the constrained rows before the sampler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from executor_svc.features.base import Feature, InvalidStep, Step, set_step_entry, step_entry
from executor_svc.features.structured.token_mask import apply_token_masks, decode_masks

__all__ = ["StructuredOutput"]


class StructuredOutput(Feature):
    """Hooks: validate (``check_step``), prepare inputs (``prepare``), sample (``before_sample``).
    Per-step data: seq_id -> the packed allowed-token row (``plan.extras["structured"]``)."""

    name = "structured"

    def check_step(self, request: Any, plan: Any, limits: Any) -> bool:
        masks = _check_token_masks(request.token_masks, plan.scheduled, limits.vocab_size)
        if masks:
            plan.extras[self.name] = masks
        return bool(masks)

    def prepare(self, plan: Any, seqs: list[Any]) -> None:
        masks: dict[str, np.ndarray] = plan.extras[self.name]
        for seq in seqs:
            mask = masks.get(seq.seq_id)
            if mask is not None:
                set_step_entry(seq, self.name, mask)

    def active(self, seqs: Sequence[Any]) -> bool:
        return any(step_entry(s, self.name) is not None for s in seqs)

    def before_sample(
        self, step: Step, sample_seq_indices: list[int], rows: list[Any], logits: Any
    ) -> list[Any]:
        # Before everything else of the sampler: it and the logprobs see the masked rows.
        masks = [step_entry(s, self.name) for s in rows]
        masked = [j for j, m in enumerate(masks) if m is not None]
        apply_token_masks(logits, masked, [masks[j] for j in masked])
        return rows


def _check_token_masks(
    masks: Any, scheduled: list[tuple[Any, int]], vocab_size: int
) -> dict[str, np.ndarray]:
    seq_ids: list[str] = []
    for i, pos in enumerate(masks.seq_positions):
        if pos >= len(scheduled):
            raise InvalidStep(
                f"token_masks.seq_positions[{i}]: {pos} is past the {len(scheduled)} sequences "
                "of this step"
            )
        seq_ids.append(scheduled[pos][0].seq_id)
    if len(set(seq_ids)) != len(seq_ids):
        raise InvalidStep("token_masks.seq_positions: a sequence appears twice")
    try:
        return decode_masks(seq_ids, masks.row_index, masks.rows, vocab_size)
    except ValueError as e:
        raise InvalidStep(f"token_masks: {e}") from None
