"""Structured-output constraints for `SamplingParams.structured_output` (llmserve.v1
StructuredOutput): build one with the helpers, e.g. `json_schema({...})`, `regex("[0-9]+")`,
`choice(["yes", "no"])`, `grammar('start: "a"+')`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from protos import scheduler_pb2 as pb

__all__ = [
    "StructuredOutput",
    "choice",
    "grammar",
    "json_object",
    "json_schema",
    "regex",
    "structural_tag",
]

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One constraint: `kind` is one of KINDS, `value` its text (a list for choice, True for
    json_object)."""

    kind: str
    value: Any

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")

    def to_proto(self) -> pb.StructuredOutput:
        if self.kind == "choice":
            return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(self.value)))
        return pb.StructuredOutput(**{self.kind: self.value})

    @classmethod
    def from_proto(cls, msg: pb.StructuredOutput) -> StructuredOutput | None:
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "choice":
            return cls(kind, list(msg.choice.choices))
        return cls(kind, getattr(msg, kind))


def _text(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def json_schema(schema: str | dict[str, Any]) -> StructuredOutput:
    """Output is JSON valid under `schema` (a dict or its JSON text)."""
    return StructuredOutput("json_schema", _text(schema))


def json_object() -> StructuredOutput:
    """Output is any JSON object."""
    return StructuredOutput("json_object", True)


def regex(pattern: str) -> StructuredOutput:
    """The whole output matches `pattern`."""
    return StructuredOutput("regex", pattern)


def choice(choices: list[str]) -> StructuredOutput:
    """Output is exactly one of `choices`."""
    return StructuredOutput("choice", list(choices))


def grammar(text: str) -> StructuredOutput:
    """Output follows a context-free grammar (Lark syntax, or GBNF)."""
    return StructuredOutput("grammar", text)


def structural_tag(tag: str | dict[str, Any]) -> StructuredOutput:
    """vLLM's structural tag ({"structures": [...], "triggers": [...]})."""
    return StructuredOutput("structural_tag", _text(tag))
