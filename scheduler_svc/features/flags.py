"""The command-line flags features declare in their own folders: each module the registry lists
(``registry.FEATURE_FLAGS``) adds its flags to the scheduler's "features" group (``add_flags``),
turns them into its section of the engine's configuration (``settings``:
``EngineConfig.features``, by feature name), and may take part in the local launcher
(``add_launch_flags``, ``launch_args``: what it adds to the executor's and the scheduler's
command lines). A feature's flags keep their names; only where they are declared moved."""

from __future__ import annotations

import argparse
from typing import Any

from scheduler_svc.features.registry import FEATURE_FLAGS

__all__ = ["add_feature_flags", "add_launch_flags", "feature_settings", "launch_args"]


def add_feature_flags(g: argparse._ArgumentGroup) -> None:
    for module in FEATURE_FLAGS:
        module.add_flags(g)


def feature_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's configuration's ``features`` (each feature's section), from the flags."""
    sections: dict[str, Any] = {}
    for module in FEATURE_FLAGS:
        sections.update(module.settings(args))
    return {"features": sections}


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
