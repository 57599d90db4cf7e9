"""Failpoints: named places where a test can make a real scheduler process fail on purpose.

Armed only by the `LLMSERVE_FAILPOINTS` environment variable, read once at import, e.g.
`LLMSERVE_FAILPOINTS="engine.process_step=1@20;engine.start=delay:1.5"`. An entry
`name=times[@skip]` makes `hit(name)` raise `InjectedFault` `times` times after letting `skip`
hits pass; `name=delay:SECONDS` makes `delay(name)` return SECONDS, for the caller to wait that
long (widening a race window that real timing leaves narrow). Tests use them to prove that the
engine survives faults and races no real input triggers reliably; with the variable unset
`ARMED` is False and each point costs one attribute check.
"""

from __future__ import annotations

from scheduler_svc import envs

__all__ = ["ARMED", "InjectedFault", "delay", "hit"]


class InjectedFault(RuntimeError):
    """Raised by an armed failpoint."""


def _parse(spec: str) -> tuple[dict[str, list[int]], dict[str, float]]:
    points: dict[str, list[int]] = {}
    delays: dict[str, float] = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, _, rest = entry.partition("=")
        if rest.startswith("delay:"):
            delays[name.strip()] = float(rest.removeprefix("delay:"))
            continue
        times, _, skip = rest.partition("@")
        points[name.strip()] = [int(skip or 0), int(times or 1)]  # [hits to skip, raises left]
    return points, delays


_POINTS, _DELAYS = _parse(envs.failpoints())
ARMED = bool(_POINTS or _DELAYS)


def delay(name: str) -> float:
    """Seconds the caller should wait at failpoint `name` (0 unless armed with a delay)."""
    return _DELAYS.get(name, 0.0)


def hit(name: str) -> None:
    """Raise InjectedFault if the failpoint `name` is armed and due."""
    state = _POINTS.get(name)
    if state is None:
        return
    if state[0] > 0:
        state[0] -= 1
        return
    if state[1] > 0:
        state[1] -= 1
        raise InjectedFault(f"failpoint {name}")
