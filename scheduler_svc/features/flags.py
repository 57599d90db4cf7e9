"""The command-line flags features register from their own folders: each module listed here
adds its flags to the scheduler's "features" group (``add_flags``), turns them into its fields
of the engine's configuration (``settings``), and may take part in the local launcher
(``add_launch_flags``, ``launch_args``: what it adds to the executor's and the scheduler's
command lines). A feature's flags keep their names; only where they are declared moved."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

from scheduler_svc.features.lora import flags as _lora
from scheduler_svc.features.spec import flags as _spec

__all__ = ["add_feature_flags", "add_launch_flags", "feature_settings", "launch_args"]

FEATURE_FLAGS: tuple[ModuleType, ...] = (_spec, _lora)


def add_feature_flags(g: argparse._ArgumentGroup) -> None:
    for module in FEATURE_FLAGS:
        module.add_flags(g)


def feature_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The features' fields of the engine's configuration, from the parsed flags."""
    fields: dict[str, Any] = {}
    for module in FEATURE_FLAGS:
        fields.update(module.settings(args))
    return fields


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    for module in FEATURE_FLAGS:
        if hasattr(module, "add_launch_flags"):
            module.add_launch_flags(p)


def launch_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """What the features add to the executor's and to the scheduler's command lines."""
    executor: list[str] = []
    scheduler: list[str] = []
    for module in FEATURE_FLAGS:
        if hasattr(module, "launch_args"):
            e, s = module.launch_args(args)
            executor += e
            scheduler += s
    return executor, scheduler
