"""LoRA's command line on the scheduler: ``--lora-modules NAME=PATH ...``, the adapters served
from the start (its field of the engine's configuration, ``EngineConfig.lora_modules``).
Registered in ``features/flags.py``."""

from __future__ import annotations

import argparse
from typing import Any

from scheduler_svc.features.lora.registry import parse_lora_modules

__all__ = ["add_flags", "settings"]


def add_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories the executors can read) served under these names",
    )


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The feature's fields of the engine's configuration (``EngineConfig``)."""
    return {"lora_modules": parse_lora_modules(args.lora_modules)}
