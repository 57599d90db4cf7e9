"""The flags features declare in their own folders: each feature's flags module (its
``Feature.flags``, taken in registry order from ``FEATURE_TYPES``, so this module names no
feature) adds its flags to the ``--help`` group of a section of ``ExecutorConfig``
(``add_flags(section, group)``; the values land in that section's fields; a feature may declare
a section of its own, ``SECTION``), may refuse a combination (``usage_error``), and hands the
server its options (``server_options``). A feature's flags keep their names; only where they
are declared moved."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

from executor_svc.features.registry import FEATURE_TYPES

__all__ = [
    "add_feature_flags",
    "feature_sections",
    "feature_server_options",
    "feature_usage_errors",
]

FEATURE_FLAGS: tuple[ModuleType, ...] = tuple(t.flags for t in FEATURE_TYPES if t.flags)


def feature_sections() -> dict[str, tuple[type, str]]:
    """The sections of ``ExecutorConfig`` features declare (a module's ``SECTION``: name, its
    settings dataclass, the --help group's description), in registration order."""
    sections = (getattr(module, "SECTION", None) for module in FEATURE_FLAGS)
    return {name: (cls, about) for name, cls, about in filter(None, sections)}


def add_feature_flags(section: str, g: argparse._ArgumentGroup) -> None:
    for module in FEATURE_FLAGS:
        module.add_flags(section, g)


def feature_usage_errors(config: Any) -> list[str]:
    """``config``: the ``ExecutorConfig``."""
    errors = (module.usage_error(config) for module in FEATURE_FLAGS)
    return [e for e in errors if e is not None]


def feature_server_options(config: Any) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for module in FEATURE_FLAGS:
        options.update(module.server_options(config))
    return options
