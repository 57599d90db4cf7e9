"""Speculation's data on the runner's view of a sequence for one step: its entry in
``ScheduledSequence.step_data`` (features/base.py ``step_entry``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from executor_svc.features.base import set_step_entry, step_entry

__all__ = ["NAME", "SpecStep", "spec_entry", "spec_of"]

NAME = "spec"  # the feature's name (SpecDecode.name)


@dataclass(slots=True)
class SpecStep:
    # Proposals at the end of the view's token_ids, verified this step.
    spec_token_ids: list[int] | tuple[()] = ()
    # Proposals the draft model makes before the forward (it then fills spec_token_ids).
    num_draft_tokens: int = 0
    # Leading positions whose draft KV is valid.
    draft_num_computed: int = 0


_NONE = SpecStep()  # what a view without an entry reads as; never written


def spec_of(seq: Any) -> SpecStep:
    """The view's speculation for this step (an empty one when it has none: read only)."""
    entry = step_entry(seq, NAME)
    return entry if entry is not None else _NONE


def spec_entry(seq: Any) -> SpecStep:
    """The view's speculation for this step, made if missing (to write)."""
    entry = step_entry(seq, NAME)
    if entry is None:
        entry = SpecStep()
        set_step_entry(seq, NAME, entry)
    return entry
