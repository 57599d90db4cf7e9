"""LoRA's part in each step: at most ``max_loras`` distinct adapters (the executor's device
slots) per step, as the scheduling core's step limit (core/step_budget.py ``StepLimit``); and
how many adapters the steps had to load onto the executor's device.

The core's requests carry their adapter as ``Request.tag`` (``ref.core_fields``); a request
of the base model has none and is never refused."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from functools import partial

from scheduler_svc.core.request import Request
from scheduler_svc.core.step_budget import StepLimitFactory
from scheduler_svc.features.lora.ref import LoraRef

__all__ = ["AdapterLimit", "LoraSlots", "adapter_limit"]


def adapter_limit(max_loras: int) -> StepLimitFactory | None:
    """The core's step limit for an executor with ``max_loras`` adapter slots (0: no cap)."""
    return partial(AdapterLimit, max_loras) if max_loras > 0 else None


class AdapterLimit:
    """The distinct adapters of one step: those of the requests already running, plus the ones
    resumed or admitted while the step is planned; never more than ``max_loras``."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.loras: set[LoraRef] = set()  # the step's, while it is planned
        self.slots = LoraSlots(max_loras)
        self.num_loads = 0  # adapters the steps so far had to load onto the device
        self.num_in_step = 0  # distinct adapters of the latest step

    def begin(self, running: list[Request]) -> None:
        self.loras = {r.tag for r in running if r.tag is not None}  # type: ignore[misc]

    def admits(self, req: Request) -> bool:
        lora = req.tag
        return lora is None or lora in self.loras or len(self.loras) < self.max_loras

    def claims(self, req: Request) -> bool:
        return req.tag is not None

    def add(self, req: Request) -> None:
        if req.tag is not None:
            self.loras.add(req.tag)  # type: ignore[arg-type]

    def scheduled(self) -> None:
        """The step's adapters against those the executor's device slots hold."""
        self.num_in_step = len(self.loras)
        if self.loras:
            self.num_loads += self.slots.use(self.loras)


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
