"""Structured-output constraints for `SamplingParams.structured_output` (llmserve.v1
StructuredOutput): build one with the helpers, e.g. `json_schema({...})`, `regex("[0-9]+")`,
`choice(["yes", "no"])`, `grammar('start: "a"+')`. Also the client `SamplingParams`'s field
(`StructuredParams`, mixed in through client/features.py) and the CLI's flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protos import sampling
from protos import scheduler_pb2 as pb

__all__ = [
    "StructuredOutput",
    "StructuredParams",
    "add_flags",
    "choice",
    "from_args",
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


@dataclass(slots=True)
class StructuredParams(sampling.SamplingParams):
    """The client's `SamplingParams.structured_output`: a `StructuredOutput` (built with
    `json_schema(...)`, `regex(...)`, ...) rather than the scheduler's one-key dict. Its default
    and place among the fields are the shared model's."""

    # Constrains the output (json_schema, regex, choice, grammar, ...).
    structured_output: StructuredOutput | None = None

    @staticmethod
    def _structured_to_proto(value: StructuredOutput) -> pb.StructuredOutput:
        return value.to_proto()

    @staticmethod
    def _structured_from_proto(so: pb.StructuredOutput) -> StructuredOutput | None:
        return StructuredOutput.from_proto(so)

    @staticmethod
    def _structured_to_dict(value: StructuredOutput) -> dict[str, Any]:
        return {value.kind: value.value}

    @staticmethod
    def _structured_from_dict(d: dict[str, Any]) -> StructuredOutput:
        ((kind, value),) = d.items()
        return StructuredOutput(kind, value)


def add_flags(gen: argparse.ArgumentParser) -> None:
    """`llmserve generate`'s flags that constrain the output."""
    gen.add_argument("--json-schema", metavar="FILE", help="constrain to this JSON Schema")
    gen.add_argument("--json-object", action="store_true", help="constrain to a JSON object")
    gen.add_argument("--regex", help="constrain the whole output to this regular expression")
    gen.add_argument("--choice", action="append", help="an allowed output (repeat for more)")
    gen.add_argument("--grammar", metavar="FILE", help="constrain to a Lark/GBNF grammar")


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `SamplingParams` fields of those flags: at most one of --json-schema FILE,
    --json-object, --regex, --choice, --grammar FILE."""
    given = [
        so
        for so in (
            args.json_schema and json_schema(Path(args.json_schema).read_text()),
            args.json_object and json_object(),
            args.regex is not None and regex(args.regex),
            args.choice and choice(args.choice),
            args.grammar and grammar(Path(args.grammar).read_text()),
        )
        if so
    ]
    if len(given) > 1:
        raise ValueError(
            "give at most one of --json-schema, --json-object, --regex, --choice, --grammar"
        )
    return {"structured_output": given[0] if given else None}
