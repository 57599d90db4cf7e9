"""LoRA's command line on the executor: ``--enable-lora`` and its limits (its own section of
``ExecutorConfig``: ``LoraSettings``, ``config.features["lora"]``), their usage check, and what
they hand the server (the manager's ``LoraConfig``). ``Lora.flags`` names this module;
features/flags.py collects it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

__all__ = ["SECTION", "LoraSettings", "add_flags", "server_options", "usage_error"]


@dataclass(frozen=True, slots=True)
class LoraSettings:
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


# The feature's section of ExecutorConfig: (name, its settings, the --help group's description).
SECTION = ("lora", LoraSettings, "LoRA adapters")


def add_flags(section: str, g: argparse._ArgumentGroup) -> None:
    if section != "lora":
        return
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (the scheduler names each sequence's PEFT directory)",
    )
    g.add_argument("--max-loras", type=int, default=4, help="distinct adapters in one step")
    g.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank")
    g.add_argument(
        "--max-cpu-loras", type=int, default=16, help="adapters kept loaded on the host (LRU)"
    )


def _lora_config(config: Any) -> Any:
    """The LoRA manager's configuration (``manager.LoraConfig``), or None without LoRA;
    ValueError if the limits are out of range."""
    lora: LoraSettings = config.features["lora"]
    if not lora.enable_lora:
        return None
    from executor_svc.features.lora.manager import LoraConfig

    return LoraConfig(lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras)


def usage_error(config: Any) -> str | None:
    """``config``: the ``ExecutorConfig``."""
    try:
        _lora_config(config)
    except ValueError as e:
        return f"--max-loras/--max-lora-rank/--max-cpu-loras: {e}"
    return None


def server_options(config: Any) -> dict[str, Any]:
    """Keyword arguments of ``ExecutorServer``: ``lora`` when LoRA is enabled."""
    lora = _lora_config(config)
    return {"lora": lora} if lora is not None else {}
