"""``--cpu-cores auto``: the cores a CPU executor takes when told to choose them itself.

One logical CPU per physical core (two hyper-threads of one core share its vector units and,
on an AMX Xeon, its tile unit: a second torch thread there adds nothing but contention), of
the CPUs this process may run on, less the lowest core: that one is left to the scheduler's,
gRPC's and the step loop's Python, which would otherwise time-share a core with a compute
thread and hold up every parallel region it waits on (issue 44; vLLM's CPU backend reserves
cores for the same reason). A process with one core keeps it. NUMA nodes are not considered:
on a multi-socket host, give the list by hand.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SYSFS = Path("/sys/devices/system/cpu")


def _parse(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def siblings(cpus: set[int], root: Path = SYSFS) -> dict[int, set[int]]:
    """Each CPU's hyper-thread siblings (itself included) as sysfs lists them; a CPU whose
    topology cannot be read is its own core."""
    out: dict[int, set[int]] = {}
    for cpu in cpus:
        try:
            out[cpu] = _parse((root / f"cpu{cpu}/topology/thread_siblings_list").read_text())
        except (OSError, ValueError):
            out[cpu] = {cpu}
    return out


def auto_cores(
    allowed: set[int], sibling_sets: Mapping[int, set[int]]
) -> tuple[set[int], int | None]:
    """(the executor's cores, the core left to Python or None): the lowest allowed CPU of
    each physical core, the lowest physical core excepted when there are two or more."""
    physical = sorted({min(sibling_sets.get(c, {c}) & allowed) for c in allowed})
    if len(physical) < 2:
        return set(physical), None
    return set(physical[1:]), physical[0]


def choose() -> tuple[set[int], int | None]:
    """``auto_cores`` for this process on this machine."""
    allowed = set(os.sched_getaffinity(0))
    return auto_cores(allowed, siblings(allowed))
