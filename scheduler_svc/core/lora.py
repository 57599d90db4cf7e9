"""LoRA in the scheduling core: which adapter a request runs with, the root of its prefix-cache
hash chain (a hit never crosses adapters), and the per-step cap on distinct adapters.

An adapter is (name, path): the registry (scheduler_svc/features/lora) resolves a name to its directory
when a request arrives, and the pair travels with the request (Redis, the step message), so an
adapter unloaded and loaded again from another directory is another adapter everywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from hashlib import blake2b


@dataclass(frozen=True, slots=True)
class LoraRef:
    name: str
    path: str


def lora_root_hash(lora: LoraRef | None) -> bytes | None:
    """Parent hash of a sequence's first block: None for the base model, else the adapter's
    (its KV differs from the base model's from the first layer's k/v projections on)."""
    if lora is None:
        return None
    h = blake2b(b"llmserve-lora\0", digest_size=16)
    h.update(lora.name.encode() + b"\0" + lora.path.encode())
    return h.digest()


class LoraBudget:
    """The distinct adapters of one step: those of the requests already running, plus the ones
    resumed or admitted while the step is planned; never more than ``max_loras`` (0: no cap)."""

    def __init__(self, max_loras: int, running: Iterable[LoraRef | None]) -> None:
        self.max_loras = max_loras
        self.loras = {lora for lora in running if lora is not None}

    def fits(self, lora: LoraRef | None) -> bool:
        return (
            lora is None
            or self.max_loras <= 0
            or lora in self.loras
            or len(self.loras) < self.max_loras
        )

    def add(self, lora: LoraRef | None) -> None:
        if lora is not None:
            self.loras.add(lora)


class LoraSlots:
    """The adapters the executor holds in its device slots, as the scheduler sees them: the
    ones the latest steps used, least recently used first, at most ``capacity`` (the executor's
    device cache is an LRU of ``max_loras``, executor_svc/features/lora/manager.py). ``use`` counts the
    adapters a step must newly load onto the device (from its host cache or from disk)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[LoraRef, None] = OrderedDict()

    def use(self, loras: Iterable[LoraRef]) -> int:
        loads = 0
        for lora in sorted(loras, key=lambda r: (r.name, r.path)):
            if lora in self._held:
                self._held.move_to_end(lora)
            else:
                self._held[lora] = None
                loads += 1
        while self.capacity > 0 and len(self._held) > self.capacity:
            self._held.popitem(last=False)
        return loads

    def held(self) -> list[LoraRef]:
        return list(self._held)


def stored_lora(lora: LoraRef | None) -> list[str] | None:
    """How a request's adapter is stored with it (Redis): [name, path], or None."""
    return None if lora is None else [lora.name, lora.path]
