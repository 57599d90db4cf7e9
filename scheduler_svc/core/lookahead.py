"""Decode steps that compute more than one new position of a sequence: the one interface the
core has for them, implemented by a feature and given to each core through its configuration
(SchedulerConfig.lookahead, set by the feature's `scheduling` hook).

A running sequence (n == 1, known to the executor) may be scheduled as its decode token plus
k lookahead positions, with KV slots for all of them, carrying the tokens computed there
(in its CachedSeqData and in the SchedulerOutput's map of them, under executor.proto's names;
or only their count when the executor supplies them). The executor returns its draw at each of
the 1 + k positions; update_from_output hands them to ``verified``, which keeps what it
accepts and gives back the slots of the rest."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from scheduler_svc.core.block_manager import BlockManager
    from scheduler_svc.core.request import Request, Sequence
    from scheduler_svc.core.scheduler_output import SchedulerOutput

__all__ = ["Lookahead", "LookaheadFactory"]


class Lookahead(Protocol):
    def active(self, num_running: int) -> bool:
        """Whether a step running this many requests schedules lookahead positions at all."""
        ...

    def eligible(self, req: Request) -> bool:
        """Whether req's decodes may have lookahead positions (its next step then depends on
        what this one accepts: no step is planned ahead)."""
        ...

    def schedule(
        self,
        bm: BlockManager,
        req: Request,
        seq: Sequence,
        budget: int,
        max_model_len: int,
        out: SchedulerOutput,
    ) -> int:
        """Schedule seq's decode with k lookahead positions into ``out`` (its entry, tokens
        and blocks) when it has any and their blocks are free; returns k (0: the caller
        schedules a plain decode)."""
        ...

    def verified(
        self, seq: Sequence, proposed: list[int], drawn: list[int], bm: BlockManager
    ) -> int:
        """Apply a step's draws at seq's 1 + len(proposed) positions (its computed count
        already advanced by all of them): append what is kept, give back the other slots;
        returns how many lookahead tokens were accepted."""
        ...


# Builds one core's lookahead (its state, counters included, lives as long as that core).
LookaheadFactory = Callable[[], Lookahead]
