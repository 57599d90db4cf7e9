"""When a draining executor's migration tries again (issue 47): plain Python, no I/O.

A drain moves what it can, then keeps the executor's leftovers in view while the executor
runs them: a request that was not movable yet (its first step not computed, swapped out) may
become movable after one of the source's steps, and one that did not fit on any destination
may fit once a destination's requests finished and freed blocks or sequence slots. Each
attempt takes the movers' lock and pauses the source and the destinations for a step, so an
attempt is made only when one of those things changed since the last attempt that left
requests behind; checking costs a few counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Room", "RetryGate"]


@dataclass(frozen=True, slots=True)
class Room:
    """What a destination could take: free device blocks and free sequence slots."""

    num_free_blocks: int
    num_free_seqs: int

    def more_than(self, other: Room) -> bool:
        return (
            self.num_free_blocks > other.num_free_blocks or self.num_free_seqs > other.num_free_seqs
        )


@dataclass(slots=True)
class RetryGate:
    """Remembers what the last attempt saw: the movable requests it left on the source and
    each destination's room. `due` says whether another attempt may move something."""

    # Movable requests the last attempt left on the source (none fitted anywhere).
    left: frozenset[str] = frozenset()
    # Each destination's room (by instance id) when the last attempt ended.
    rooms: dict[str, Room] = field(default_factory=dict)
    # False until the first attempt: the first one is always due.
    tried: bool = False

    def due(self, movable: list[str], rooms: dict[str, Room]) -> bool:
        """Whether an attempt may move something now: some request is movable, and either
        it was not movable (or not there) at the last attempt, or some destination has more
        room than it had then (a destination new since then counts as more room)."""
        if not movable:
            return False
        if not self.tried or not self.left.issuperset(movable):
            return True
        return any(r.more_than(self.rooms.get(k, Room(-1, -1))) for k, r in rooms.items())

    def record(self, left: list[str], rooms: dict[str, Room]) -> None:
        """An attempt ended with `left` movable requests still on the source and the
        destinations holding `rooms`."""
        self.tried = True
        self.left = frozenset(left)
        self.rooms = dict(rooms)
