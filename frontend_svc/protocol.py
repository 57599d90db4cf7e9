"""Request bodies of the OpenAI API as this frontend accepts them (pydantic), and their
translation into the scheduler's sampling parameters.

Fields follow the OpenAI API reference; vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, skip_special_tokens, stop_token_ids,
include_stop_str_in_output, priority) are accepted in the body as vLLM accepts them, and so
are the optional features' fields (mixed in from features.BODY_FIELDS, turned into sampling
parameters by features.to_params). Tools and tool_choice: tool_calling/protocol.py.

Unlike vLLM, an unknown field is a 400 naming it (`extra="forbid"`): a client that asked for
something must hear that it was not done. The few fields that clients send and that mean
nothing here are declared below with the values accepted (the allow-list, docs/openai.md):
`user`, `safety_identifier` and `prompt_cache_key` (labels; the prefix cache needs no key),
`store` and `service_tier` only with the values that ask for nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.params import SamplingParams
from client.prompts import ChatPrompt, InfillPrompt
from frontend_svc import features
from frontend_svc.errors import bad_request
from frontend_svc.tool_calling.models import Tool, ToolCall, ToolChoice
from frontend_svc.tool_calling.protocol import ToolConfig, ToolPlan, plan_tools


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: the usage so far on every chunk (guidellm asks for it).
    continuous_usage_stats: bool = False


class _Common(*features.BODY_FIELDS, BaseModel):  # type: ignore[misc]
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # The allow-list: labels a client may send that change nothing of the output.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Only the values that ask for nothing: nothing is stored, there is one service tier.
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    priority: int = 0
    prompt_logprobs: int | None = None
    # Seconds the request may take from arrival (serving.request_timeout; the scheduler's
    # features/deadlines): waiting past it is a 408, running past it finishes as "length".
    timeout: float | None = None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, plan: ToolPlan | None = None
    ) -> SamplingParams:
        if self.prompt_logprobs is not None and self.stream:
            # As vLLM: they would arrive before any token, in no chunk type the API defines.
            raise bad_request(
                "prompt_logprobs is not available with stream=true", "prompt_logprobs"
            )
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self._logit_bias(),
            prompt_logprobs=self.prompt_logprobs,
        )
        features.to_params(self, params, plan)
        if params.seed is not None and params.seed < 0:
            raise bad_request("seed must be >= 0", "seed")
        return params

    def _logit_bias(self) -> dict[int, float]:
        # OpenAI sends token ids as JSON object keys, hence strings; range checks are the
        # scheduler's (its INVALID_ARGUMENT message comes back as a 400).
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key[:32]!r}", "logit_bias"
                ) from None
            if not 0 <= token_id < 2**32:
                raise bad_request(f"logit_bias has token id {token_id} out of range", "logit_bias")
            out[token_id] = bias
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int] | InfillPrompt]:
        """The prompts; with `suffix`, fill-in-the-middle prompts (text prompts only)."""
        prompts = self._prompts()
        if not self.suffix:
            return prompts
        if not all(isinstance(p, str) for p in prompts):
            raise bad_request("suffix needs text prompts, not token ids", "suffix")
        return [InfillPrompt(p, self.suffix) for p in prompts]  # type: ignore[arg-type]

    def _prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_params(self) -> SamplingParams:
        if self.suffix and self.echo:
            raise bad_request("echo is not supported with suffix", "echo")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad_request(f"max_tokens must be >= 0, got {self.max_tokens}", "max_tokens")
        if self.max_tokens == 0 and not self.echo:
            # As vLLM: generating nothing only makes sense to read the prompt's logprobs back.
            raise bad_request(
                f"max_tokens must be at least 1 unless echo is true, got {self.max_tokens}",
                "max_tokens",
            )
        params = self.sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            # Echo's logprobs cover the prompt's tokens: the scheduler's prompt logprobs, with
            # as many alternatives as either field asks for.
            params.prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        if self.best_of is None:
            return params
        # As vLLM: best_of candidates are generated and the n best returned, which a stream
        # (sending tokens before the candidates are known) cannot do.
        if self.stream:
            raise bad_request("best_of is not supported with stream=true", "best_of")
        if self.best_of < self.n:
            raise bad_request(
                f"best_of must be >= n, got best_of={self.best_of} and n={self.n}", "best_of"
            )
        # Candidates are ranked by their sampled tokens' logprobs, so they are asked for
        # (0: the sampled token alone) even when the client did not; they are returned only if
        # it did. The scheduler checks best_of against n's limits.
        params.n = self.best_of
        if params.logprobs is None:
            params.logprobs = 0
        return params


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    # An earlier answer's reasoning, handed to the template (Qwen3's reads it).
    reasoning_content: str | None = None
    # What an assistant message returned by the openai client holds when sent back as is;
    # only the empty values, which say nothing.
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = Field(default=None, max_length=0)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated spelling of tools: not honoured, so a 400.
    functions: Any = None
    function_call: Any = None
    # Output other than text: only the value that asks for text.
    modalities: list[Literal["text"]] | None = None

    def plan(self, config: ToolConfig) -> ToolPlan:
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is not supported; use tools and tool_choice", name)
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, config)

    def to_params(self, max_model_len: int, plan: ToolPlan | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad_request(f"{name} must be at least 1, got {value}", name)
        max_tokens = self.max_completion_tokens or self.max_tokens
        # As vLLM: with no limit, generate until the model's maximum length.
        params = self.sampling_params(max_tokens or max_model_len, None, plan)
        if self.logprobs:
            params.logprobs = self.top_logprobs or 0
        keep = plan.parser.skip_special_tokens if plan is not None and plan.parser else None
        if keep is not None:
            params.skip_special_tokens = keep
        return params

    def chat(self, plan: ToolPlan | None = None) -> ChatPrompt:
        return ChatPrompt(
            [m.to_dict() for m in self.messages],
            self.add_generation_prompt,
            tools=plan.tools if plan is not None else None,
        )


def chat_request(**fields: Any) -> ChatCompletionRequest:
    """A chat request another API's body translates into; what fails its checks is a 400 (the
    other body's fields were checked, so the message names the chat field)."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        errors = e.errors()
        where = ".".join(str(x) for x in errors[0]["loc"]) if errors else None
        msg = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in errors)
        raise bad_request(msg or "invalid request", where) from None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None  # handed to the chat template, as vLLM's /tokenize


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
