"""What one ``Scheduler.schedule()`` call has left to give, shared by its phases, and how an
admission attempt ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler_svc.core.lora import LoraBudget
from scheduler_svc.core.request import Request, Sequence

__all__ = ["Admit", "StepBudget"]


@dataclass(slots=True)
class StepBudget:
    """What one schedule() call has left to give, shared by its phases."""

    tokens: int  # of max_num_batched_tokens
    num_seqs: int = 0  # sequences running after this step so far (max_num_seqs caps it)
    prefills: list[tuple[Request, Sequence]] = field(default_factory=list)  # for phase 2
    added: list[Request] = field(default_factory=list)  # swapped in or admitted this step
    # Distinct LoRA adapters in the step (max_loras); set once the running requests are known.
    loras: LoraBudget = field(default_factory=lambda: LoraBudget(0, ()))


class Admit(enum.Enum):
    ADMITTED = enum.auto()
    WAIT = enum.auto()  # head of the line: nothing behind it goes first
    ENDED = enum.auto()  # could never fit; ended with an error
