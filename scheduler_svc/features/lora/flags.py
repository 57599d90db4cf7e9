"""LoRA's command line on the scheduler: ``--lora-modules NAME=PATH ...``, the adapters served
from the start (its section of the engine's configuration, ``EngineConfig.features["lora"]``:
``LoraSettings``). Registered through ``features/registry.py``'s ``FEATURE_FLAGS``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.features.lora.registry import parse_lora_modules

__all__ = ["LoraSettings", "add_flags", "settings"]


@dataclass(frozen=True, slots=True)
class LoraSettings:
    # Adapters registered at start (--lora-modules name=path): (name, PEFT directory).
    modules: list[tuple[str, str]] = field(default_factory=list)


def add_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories the executors can read) served under these names",
    )


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The feature's section of the engine's configuration (``EngineConfig.features``)."""
    return {"lora": LoraSettings(parse_lora_modules(args.lora_modules))}
