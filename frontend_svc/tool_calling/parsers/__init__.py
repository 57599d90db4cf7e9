"""Tool-call parsers by name (`--tool-call-parser`, vLLM's names). A parser registers itself
with `@register_tool_parser(name)`; `--tool-parser-plugin FILE` imports a file that does."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from frontend_svc.tool_calling.parsers.base import PartialCall, Scan, ToolParser

__all__ = [
    "PartialCall",
    "Scan",
    "ToolParser",
    "load_plugin",
    "parser_class",
    "parser_names",
    "register_tool_parser",
]

P = TypeVar("P", bound=type[ToolParser])
_PARSERS: dict[str, type[ToolParser]] = {}
# Modules of the parsers that ship with the frontend, imported on first look-up.
_BUILTIN = (
    "frontend_svc.tool_calling.parsers.hermes",
    "frontend_svc.tool_calling.parsers.llama3_json",
)


def register_tool_parser(name: str) -> Callable[[P], P]:
    def register(cls: P) -> P:
        cls.name = name
        _PARSERS[name] = cls
        return cls

    return register


def _load_builtin() -> None:
    for module in _BUILTIN:
        importlib.import_module(module)


def parser_names() -> list[str]:
    _load_builtin()
    return sorted(_PARSERS)


def parser_class(name: str) -> type[ToolParser]:
    _load_builtin()
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; expected one of {', '.join(parser_names())}"
        ) from None


def load_plugin(path: str | Path) -> None:
    """Import a Python file that registers parsers (vLLM's --tool-parser-plugin)."""
    spec = importlib.util.spec_from_file_location(f"llmserve_tool_plugin_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import tool parser plugin {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
