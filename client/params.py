"""Client-side sampling parameters: the one model of `llmserve.v1.SamplingParams`
(protos/sampling.py: fields, vLLM's defaults, the proto both ways, the stored form), which the
scheduler uses too, with the client's conveniences on top.

What the client adds: `stop` may be a single string, `max_tokens=None` leaves the length to the
server (whose default is also 16), and a constraint is a `client.structured.StructuredOutput`
(built with `json_schema(...)`, `regex(...)`, ...) rather than the scheduler's one-key dict.
The server validates every field and answers `INVALID_ARGUMENT` naming the one out of range,
with the rules of the shared model's `validate()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from client.structured import StructuredOutput
from protos import sampling
from protos import scheduler_pb2 as pb

__all__ = ["SamplingParams"]


@dataclass(slots=True)
class SamplingParams(sampling.SamplingParams):
    # The fields below change only their type; their defaults and order are the shared model's.
    max_tokens: int | None = 16  # None leaves it to the server (its default is also 16)
    # A single string is accepted for convenience and normalised to a list.
    stop: list[str] | str = field(default_factory=list)
    # Constrains the output (client/structured.py: json_schema, regex, choice, grammar, ...).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

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
