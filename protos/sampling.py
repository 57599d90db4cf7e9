"""The one model of `llmserve.v1.SamplingParams`: its fields with vLLM's defaults, the rules a
request's parameters must meet (each message names the field), the public proto both ways, and
the dict form the scheduler stores in Redis.

Why here, in `protos`: the client and the scheduler both need this model, and `protos` is the
one package the two may share (a client never imports the scheduler, nor the reverse). The
model is the Python face of a contract message that lives beside it, so a field added to
`scheduler.proto` is added here once, for every side. It is a plain dataclass and importing it
loads no protobuf: the conversions import the generated module when they are called, so the
scheduling core, which touches no wire types, can hold it (tests/unit/test_import_graph.py).

Who uses which form: the scheduler's class is this one (scheduler_svc/core/sampling_params.py
re-exports it), holding a constraint as a one-key dict mirroring the proto's oneof; the client's
(client/params.py) is a thin subclass that takes `stop="x"` and `max_tokens=None` and holds a
constraint as a `client.structured.StructuredOutput`. The executor's is the step message's form
(`llmserve.executor.v1.SamplingParams`, executor_svc/runner/sampler.py), built by the
scheduler's engine/fleet/step_message.py.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from protos import scheduler_pb2 as pb

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LEN",
    "MAX_STOP_TOKEN_IDS",
    "SamplingParams",
    "ValidationError",
]

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_LIMIT = 100.0


class ValidationError(ValueError):
    """Invalid user input; the message names the offending field and is safe to show a client."""


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per token; None = none
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to logit
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token; None = none
    # One-key dict mirroring the public StructuredOutput oneof, e.g. {"regex": "[0-9]+"};
    # compiled and enforced by scheduler_svc/features/structured. None = unconstrained.
    structured_output: dict[str, Any] | None = None
    # Opt out of speculative decoding (--speculative-config); outputs are the same either way.
    disable_speculation: bool = False

    def validate(self, *, max_logprobs: int, vocab_size: int | None = None) -> None:
        """Raise ValidationError naming the first field out of range."""
        if not 1 <= self.n <= MAX_N:
            raise ValidationError(f"params.n must be in [1, {MAX_N}], got {self.n}")
        # 0 is a prompt-only request (scoring with prompt_logprobs): it ends after its prefill.
        if self.max_tokens < 0:
            raise ValidationError(f"params.max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValidationError(
                f"params.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}"
            )
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValidationError(f"params.temperature must be >= 0, got {self.temperature}")
        _finite("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValidationError(f"params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValidationError(f"params.top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        _finite("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValidationError(f"params.min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2 <= value <= 2:
                raise ValidationError(f"params.{name} must be in [-2, 2], got {value}")
        _finite("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 2:
            raise ValidationError(
                f"params.repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValidationError(f"params.seed must be in [0, 2^63), got {self.seed}")
        self._validate_stop(vocab_size)
        self._validate_logit_bias(vocab_size)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            raise ValidationError(
                f"params.prompt_logprobs must be in [0, {max_logprobs}], got {self.prompt_logprobs}"
            )
        so = self.structured_output
        if so is not None and (not isinstance(so, dict) or len(so) != 1):
            raise ValidationError("params.structured_output must set exactly one kind")
        if so is not None and (self.ignore_eos or self.min_tokens):
            # The grammar ends a sequence through EOS, which both of these would suppress.
            raise ValidationError(
                "params.structured_output cannot be combined with ignore_eos or min_tokens"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise ValidationError(
                f"params.logprobs must be in [0, {max_logprobs}], got {self.logprobs}"
            )

    def _validate_stop(self, vocab_size: int | None) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValidationError(
                f"params.stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_LEN:
                raise ValidationError(
                    f"params.stop strings must be 1..{MAX_STOP_STRING_LEN} characters long"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValidationError(
                f"params.stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}"
            )
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValidationError(
                        f"params.stop_token_ids contains {t}, outside the vocabulary "
                        f"[0, {vocab_size})"
                    )

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValidationError(
                f"params.logit_bias may hold at most {MAX_LOGIT_BIAS} entries, "
                f"got {len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                raise ValidationError(
                    f"params.logit_bias has token id {token_id}, outside the vocabulary "
                    f"[0, {vocab_size})"
                )
            if not (math.isfinite(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
                raise ValidationError(
                    f"params.logit_bias[{token_id}] must be in [-{LOGIT_BIAS_LIMIT:g}, "
                    f"{LOGIT_BIAS_LIMIT:g}], got {bias}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def step_by_step(self) -> bool:
        """Whether each step's sampling depends on the tokens of the step before (a constrained
        request's mask is computed from them): the scheduler plans none of its steps before the
        previous one is applied (core/ahead.py) and verifies no proposed tokens for it
        (features/spec/decode.py)."""
        return self.structured_output is not None

    # ------------------------------------------------------------------ the public proto

    def to_proto(self) -> pb.SamplingParams:
        """The wire message. Every `optional` field is sent explicitly (None leaves it unset),
        so that the request means the same thing whatever the server's defaults become."""
        from protos import scheduler_pb2 as pb

        msg = pb.SamplingParams()
        for name in _PROTO_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if name == "structured_output":
                msg.structured_output.CopyFrom(self._structured_to_proto(value))
            elif name in ("stop", "stop_token_ids"):
                getattr(msg, name).extend(value)
            elif name == "logit_bias":
                msg.logit_bias.update(value)
            else:
                setattr(msg, name, value)
        return msg

    @classmethod
    def from_proto(cls, msg: pb.SamplingParams) -> Self:
        """Inverse of `to_proto`: an unset optional field takes this class's default. A
        structured_output set with no kind is ValidationError (the scheduler's answer)."""
        kwargs: dict[str, Any] = {}
        for name, has_presence in _proto_fields(msg.DESCRIPTOR):
            if has_presence and not msg.HasField(name):
                continue
            value = getattr(msg, name)
            if name == "structured_output":
                value = cls._structured_from_proto(value)
            elif name in ("stop", "stop_token_ids"):
                value = list(value)
            elif name == "logit_bias":
                value = dict(value)
            kwargs[name] = value
        return cls(**kwargs)

    # How structured_output is held: here as the one-key dict (also its stored form); a
    # subclass holding another type (the client's StructuredOutput) overrides these four.

    @staticmethod
    def _structured_to_proto(value: Any) -> pb.StructuredOutput:
        from protos import scheduler_pb2 as pb

        if not isinstance(value, dict) or len(value) != 1:
            raise ValidationError("params.structured_output must set exactly one kind")
        ((kind, v),) = value.items()
        if kind == "choice":
            return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(v)))
        return pb.StructuredOutput(**{kind: v})

    @staticmethod
    def _structured_from_proto(so: pb.StructuredOutput) -> Any:
        kind = so.WhichOneof("kind")
        if kind is None:
            raise ValidationError("params.structured_output must set one of its kinds")
        if kind == "choice":
            return {"choice": list(so.choice.choices)}
        return {kind: getattr(so, kind)}

    @staticmethod
    def _structured_to_dict(value: Any) -> dict[str, Any]:
        return value

    @staticmethod
    def _structured_from_dict(d: dict[str, Any]) -> Any:
        return d

    # ------------------------------------------------------------------ stored form

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (how the store keeps a request's parameters)."""
        d = dataclasses.asdict(self)
        if self.structured_output is not None:
            d["structured_output"] = copy.deepcopy(self._structured_to_dict(self.structured_output))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """From `to_dict`'s form; fields this version does not know are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        out = cls(**{k: v for k, v in d.items() if k in known})
        # JSON object keys are strings: token ids come back as "123".
        out.logit_bias = {int(k): float(v) for k, v in out.logit_bias.items()}
        if out.structured_output is not None:
            out.structured_output = cls._structured_from_dict(out.structured_output)
        return out

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes` applied (lists are copied, not shared)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["stop"] = list(values["stop"])
        values["stop_token_ids"] = list(values["stop_token_ids"])
        values["logit_bias"] = dict(values["logit_bias"])
        values.update(changes)
        return type(self)(**values)


# The fields the public message carries (a subclass may add fields of its own, e.g. the
# scheduler's EmbedSamplingParams.pooling, which the public message does not carry).
_PROTO_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@functools.cache
def _proto_fields(descriptor: Any) -> tuple[tuple[str, bool], ...]:
    """(name, whether the proto tracks its presence) per field, read once from the descriptor."""
    by_name = descriptor.fields_by_name
    return tuple((name, by_name[name].has_presence) for name in _PROTO_FIELDS)


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValidationError(f"params.{name} must be a finite number, got {value}")
