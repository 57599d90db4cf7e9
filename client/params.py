"""Client-side sampling parameters, mirroring `llmserve.v1.SamplingParams` with vLLM's defaults.

The server validates every field and answers `INVALID_ARGUMENT` naming the one out of range, so
this class only converts; it does not duplicate the server's rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from client.structured import StructuredOutput
from protos import scheduler_pb2 as pb


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None leaves it to the server (its default is also 16)
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # A single string is accepted for convenience and normalised to a list.
    stop: list[str] | str = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per token; None = none
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token; None = none
    # Constrains the output (client/structured.py: json_schema, regex, choice, grammar, ...).
    structured_output: StructuredOutput | None = None
    # Opt out of the server's speculative decoding (same tokens either way, only the speed).
    disable_speculation: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    def to_proto(self) -> pb.SamplingParams:
        """The wire message; every `optional` field this class knows is sent explicitly so that
        the request means the same thing whatever the server's defaults become."""
        msg = pb.SamplingParams(
            n=self.n,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            disable_speculation=self.disable_speculation,
        )
        if self.max_tokens is not None:
            msg.max_tokens = self.max_tokens
        if self.seed is not None:
            msg.seed = self.seed
        if self.logprobs is not None:
            msg.logprobs = self.logprobs
        if self.prompt_logprobs is not None:
            msg.prompt_logprobs = self.prompt_logprobs
        if self.structured_output is not None:
            msg.structured_output.CopyFrom(self.structured_output.to_proto())
        return msg

    @classmethod
    def from_proto(cls, msg: pb.SamplingParams) -> SamplingParams:
        """Inverse of `to_proto`; unset optional fields take this class's defaults."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if msg.DESCRIPTOR.fields_by_name[f.name].has_presence and not msg.HasField(f.name):
                continue
            value = getattr(msg, f.name)
            if f.name == "structured_output":
                value = StructuredOutput.from_proto(value)
            elif f.name in ("stop", "stop_token_ids"):
                value = list(value)
            elif f.name == "logit_bias":
                value = dict(value)
            kwargs[f.name] = value
        return cls(**kwargs)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied (lists are copied, not shared)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["stop"] = list(values["stop"])
        values["stop_token_ids"] = list(values["stop_token_ids"])
        values["logit_bias"] = dict(values["logit_bias"])
        values.update(changes)
        return SamplingParams(**values)
