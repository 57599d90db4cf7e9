"""A step's LoRA adapters checked before anything changes: the runner serves LoRA, the step
holds at most ``--max-loras`` adapters, and each new adapter loads (read from its directory into
the runner's cache now, so that a bad one is refused as INVALID_ARGUMENT naming it instead of
failing the forward pass of every sequence in the step)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from executor_svc.features.lora.manager import adapter_of
from executor_svc.features.lora.peft import LoraError


def check_step_loras(states: Iterable[Any], lora: Any) -> tuple[str | None, bool]:
    """Why the step cannot run (None if it can), and whether any sequence has an adapter;
    ``states`` are the step's SeqStates and ``lora`` the runner's ``LoraManager`` (None when
    LoRA is off)."""
    keys = {k for k in map(adapter_of, states) if k is not None}
    if not keys:
        return None, False
    if lora is None:
        return (
            f"LoRA adapter {sorted(keys)[0][0]!r} asked for but this executor serves no LoRA",
            True,
        )
    if len(keys) > lora.config.max_loras:
        return (
            f"the step holds {len(keys)} LoRA adapters; --max-loras is {lora.config.max_loras}",
            True,
        )
    for name, path in sorted(keys):
        if not path:
            return f"LoRA adapter {name!r} was sent without its directory", True
        try:
            lora.load(name, path)
        except LoraError as e:
            return str(e), True
    return None, True
