"""Client-side sampling parameters: the one model of `llmserve.v1.SamplingParams`
(protos/sampling.py: fields, vLLM's defaults, the proto both ways, the stored form), which the
scheduler uses too, with the client's conveniences on top.

What the client adds: `stop` may be a single string, `max_tokens=None` leaves the length to the
server (whose default is also 16), and the optional features' fields take the client's types
(their mixins, composed in client/features.py: a constraint on the output, say).
The server validates every field and answers `INVALID_ARGUMENT` naming the one out of range,
with the rules of the shared model's `validate()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from client.features import ParamsFeatures

__all__ = ["SamplingParams"]


@dataclass(slots=True)
class SamplingParams(ParamsFeatures):
    # The fields below change only their type; their defaults and order are the shared model's.
    max_tokens: int | None = 16  # None leaves it to the server (its default is also 16)
    # A single string is accepted for convenience and normalised to a list.
    stop: list[str] | str = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
