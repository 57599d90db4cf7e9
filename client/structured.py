"""Structured outputs: the one grammar a request's output is held to (`SamplingParams.
structured_output`), mirroring `llmserve.v1.StructuredOutput` and vLLM's
`StructuredOutputsParams` (json, regex, choice, grammar, json_object, structural_tag).

The server validates the constraint (a bad schema, regex or grammar is INVALID_ARGUMENT with the
grammar library's message); this class only checks that exactly one kind is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from protos import scheduler_pb2 as pb


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    json_schema: str | dict[str, Any] | None = None  # a JSON Schema (text or object)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it
    choice: tuple[str, ...] | list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # Lark, or GBNF/EBNF as vLLM accepts it
    structural_tag: str | dict[str, Any] | None = None  # vLLM's structural_tag, text or object

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"a StructuredOutput takes exactly one kind, got {', '.join(given) or 'none'}"
            )

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def to_proto(self) -> pb.StructuredOutput:
        kind = self.kind
        value = getattr(self, kind)
        if kind == "choice":
            return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(value)))
        if kind in ("json_schema", "structural_tag") and not isinstance(value, str):
            value = json.dumps(value, ensure_ascii=False)
        return pb.StructuredOutput(**{kind: value})

    @classmethod
    def from_proto(cls, msg: pb.StructuredOutput) -> StructuredOutput | None:
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        if kind == "choice":
            return cls(choice=tuple(msg.choice.choices))
        return cls(**{kind: getattr(msg, kind)})
