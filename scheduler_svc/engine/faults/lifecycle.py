"""The engine's lifecycle: one state, and one answer to "why not serving?" for health and requests.

```
 STANDBY ──lease acquired──▶ STARTING ──executors connected, requests recovered──▶ SERVING
    (leader election only)       │                                                   │
                                 └──────────────── stop() ──▶ STOPPING ◀─────────────┘
 any state ──lease lost, or a write or step fenced──▶ LOST_LEADERSHIP (final: the process
                                                      starts over as a standby)
```

Only SERVING serves. STOPPING and LOST_LEADERSHIP both stop the step loops; they differ in
whether the lease is handed over (a clean stop) and in what a client is told.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from scheduler_svc.core.errors import Unavailable

__all__ = ["EngineState", "Lifecycle"]


class EngineState(enum.Enum):
    STANDBY = "standby"  # waiting for the leader lease (--leader-election)
    STARTING = "starting"  # connecting executors, loading the tokenizer, recovering requests
    SERVING = "serving"
    STOPPING = "stopping"  # stop() was called: nothing new, the loops end
    LOST_LEADERSHIP = "lost_leadership"  # another scheduler leads: nothing more is written


# What a client (UNAVAILABLE) and the health log are told in each state but SERVING.
_WHY_NOT_SERVING = {
    EngineState.STANDBY: "standby scheduler: another scheduler holds the leader lease",
    EngineState.STARTING: (
        "scheduler is starting (connecting executors, recovering requests); retry shortly"
    ),
    EngineState.STOPPING: "scheduler is shutting down",
    EngineState.LOST_LEADERSHIP: "this scheduler is no longer the leader; retry",
}


class Lifecycle:
    """The engine's state. `watchers` run after every change (health, the engine's reaction)."""

    def __init__(self, leader_election: bool) -> None:
        self.state = EngineState.STANDBY if leader_election else EngineState.STARTING
        self.lost_reason: str | None = None  # why leadership was lost
        self.leadership_lost = asyncio.Event()  # the CLI restarts the process as a standby
        # A configuration the executors cannot serve (e.g. a model part a feature needs): the CLI
        # exits with this message, no traceback.
        self.failure: str | None = None
        self.failed = asyncio.Event()
        self.watchers: list[Callable[[], None]] = []

    @property
    def serving(self) -> bool:
        return self.state is EngineState.SERVING

    @property
    def stopping(self) -> bool:
        """The step loops end: stop() was called or leadership was lost."""
        return self.state in (EngineState.STOPPING, EngineState.LOST_LEADERSHIP)

    def why_not_serving(self) -> str | None:
        """Why requests that read engine state are refused now (None: they are not). Until
        recovery has finished, the tokenizer, the model's limits and the set of resumed requests
        are incomplete."""
        return _WHY_NOT_SERVING.get(self.state)

    def check(self) -> None:
        """Raise UNAVAILABLE with the reason unless serving."""
        if self.state is not EngineState.SERVING:
            raise Unavailable(_WHY_NOT_SERVING[self.state])

    def elected(self) -> None:
        if self.state is EngineState.STANDBY:
            self._become(EngineState.STARTING)

    def started(self) -> None:
        if self.state is EngineState.STARTING:
            self._become(EngineState.SERVING)

    def stop(self) -> None:
        if self.state is not EngineState.LOST_LEADERSHIP:
            self._become(EngineState.STOPPING)

    def fail(self, reason: str) -> None:
        """Start-up found a configuration that cannot serve: stop, and say why."""
        self.failure = reason
        self.stop()
        self.failed.set()

    def lose_leadership(self, reason: str) -> None:
        """Another scheduler leads now (lease lost, or a write or step was fenced). Once."""
        if self.state is EngineState.LOST_LEADERSHIP:
            return
        self.lost_reason = reason
        self._become(EngineState.LOST_LEADERSHIP)
        self.leadership_lost.set()

    def _become(self, state: EngineState) -> None:
        self.state = state
        for watcher in self.watchers:
            watcher()
