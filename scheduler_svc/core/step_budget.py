"""What one ``Scheduler.schedule()`` call has left to give, shared by its phases, how an
admission attempt ended, and the one admission constraint a feature may add to a step."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler_svc.core.request import Request, Sequence

__all__ = ["Admit", "StepBudget", "StepLimit", "StepLimitFactory"]


class StepLimit(Protocol):
    """A cap on what one step may hold besides tokens and sequences (say, distinct values of
    the requests' ``tag``), given to each core by a feature (SchedulerConfig.step_limit).

    Per step, once the running requests are known: ``begin`` with them; a swapped or waiting
    request joins the step only if ``admits`` says so, then ``add``; ``scheduled`` when the
    step computes anything. A waiting request it refuses is skipped for the step, keeping its
    place; once one has been skipped for ``Scheduler.starvation_steps`` steps, no request the
    limit ``claims`` (one that holds any of what it counts) is admitted behind it, so that what
    the step holds drains and it gets its turn."""

    def begin(self, running: list[Request]) -> None: ...

    def admits(self, req: Request) -> bool: ...

    def claims(self, req: Request) -> bool: ...

    def add(self, req: Request) -> None: ...

    def scheduled(self) -> None: ...


# Builds one core's limit (its state lives as long as that core).
StepLimitFactory = Callable[[], StepLimit]


@dataclass(slots=True)
class StepBudget:
    """What one schedule() call has left to give, shared by its phases."""

    tokens: int  # of max_num_batched_tokens
    num_seqs: int = 0  # sequences running after this step so far (max_num_seqs caps it)
    prefills: list[tuple[Request, Sequence]] = field(default_factory=list)  # for phase 2
    added: list[Request] = field(default_factory=list)  # swapped in or admitted this step


class Admit(enum.Enum):
    ADMITTED = enum.auto()
    WAIT = enum.auto()  # head of the line: nothing behind it goes first
    ENDED = enum.auto()  # could never fit; ended with an error
