"""``--cpu-cores``: its lists of cores (Linux's cpuset notation), and with ``auto`` the cores a CPU
executor takes when told to choose them itself.

``auto``: one logical CPU per physical core (two hyper-threads of one core share its vector units and,
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


def parse_cpu_list(text: str) -> set[int]:
    """CPU ids from a list such as ``0-3,8`` (Linux's cpuset notation)."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a list of cores such as 0-3,8")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{part.strip()!r}: the range runs backwards")
        cores.update(range(first, last + 1))
    return cores


def format_cpu_list(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def siblings(cpus: set[int], root: Path = SYSFS) -> dict[int, set[int]]:
    """Each CPU's hyper-thread siblings (itself included) as sysfs lists them; a CPU whose
    topology cannot be read is its own core."""
    out: dict[int, set[int]] = {}
    for cpu in cpus:
        try:
            out[cpu] = parse_cpu_list(
                (root / f"cpu{cpu}/topology/thread_siblings_list").read_text()
            )
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
