"""Prompt forms the client accepts, and building `GenerateRequest` messages from them.

A single prompt is one of: a string; a list of token ids; a list of chat messages
(`{"role": ..., "content": ...}`, in OpenAI's shape: an assistant message may carry
`tool_calls`, a "tool" message `tool_call_id` and `name`); or a dict `{"prompt": str}`,
`{"prompt_token_ids": [...]}`, `{"messages": [...], "add_generation_prompt": bool, "tools":
[...]}`. A batch is a list of single prompts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from client.params import SamplingParams
from protos import scheduler_pb2 as pb


@dataclass(slots=True)
class ChatPrompt:
    """Chat messages rendered by the model's chat template. `tools` (OpenAI tool objects,
    `{"type": "function", "function": {"name", "description", "parameters"}}`) are handed to
    the template as `tools`."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None


# Message keys besides role and content that travel to the chat template.
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    out = {"role": m["role"], "content": m.get("content") or ""}
    out.update({k: m[k] for k in _TOOL_KEYS if m.get(k)})
    return out


def _message_to_proto(m: Mapping[str, Any]) -> pb.ChatMessage:
    calls = m.get("tool_calls")
    return pb.ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        tool_calls_json=json.dumps(list(calls), ensure_ascii=False) if calls else "",
        tool_call_id=m.get("tool_call_id") or "",
        name=m.get("name") or "",
    )


@dataclass(slots=True)
class InfillPrompt:
    """Fill in the middle: the model generates what goes between `prefix` and `suffix` (needs a
    model with FIM tokens)."""

    prefix: str
    suffix: str


PromptInput = str | list[int] | ChatPrompt | InfillPrompt


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in value)
    )


def to_prompt(value: Any) -> PromptInput:
    """One prompt in any accepted form -> its canonical form; TypeError for anything else."""
    if isinstance(value, str | ChatPrompt | InfillPrompt):
        return value
    if _is_token_ids(value):
        return [int(t) for t in value]
    if _is_chat(value):
        return ChatPrompt([_message(m) for m in value])
    if isinstance(value, Mapping):
        if "prompt_token_ids" in value:
            return [int(t) for t in value["prompt_token_ids"]]
        if "messages" in value:
            chat = to_prompt(list(value["messages"]))
            assert isinstance(chat, ChatPrompt)
            chat.add_generation_prompt = bool(value.get("add_generation_prompt", True))
            chat.tools = list(value["tools"]) if value.get("tools") else None
            return chat
        if "prompt" in value:
            return str(value["prompt"])
    raise TypeError(
        "a prompt must be a string, a list of token ids, a list of chat messages or a dict "
        f"with 'prompt', 'prompt_token_ids' or 'messages'; got {type(value).__name__}"
    )


def normalize_prompts(prompts: Any) -> list[PromptInput]:
    """A single prompt or a batch of prompts -> a list of canonical prompts.

    A flat list of ints is one token-id prompt and a flat list of messages is one chat, so
    callers can pass a single prompt of either kind without wrapping it.
    """
    if isinstance(prompts, str | ChatPrompt | InfillPrompt | Mapping) or _is_token_ids(prompts):
        return [to_prompt(prompts)]
    if _is_chat(prompts):
        return [to_prompt(prompts)]
    if isinstance(prompts, Sequence):
        return [to_prompt(p) for p in prompts]
    raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")


def broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: a single one is shared, a list must match the prompts."""
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    return params


def build_request(
    prompt: PromptInput,
    params: SamplingParams,
    *,
    request_id: str | None = None,
    priority: int = 0,
    detached: bool = False,
    lora_adapter: str = "",
    timeout_s: float | None = None,
) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=request_id or "",
        params=params.to_proto(),
        priority=priority,
        detached=detached,
        lora_adapter=lora_adapter,
        timeout_s=timeout_s,
    )
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, ChatPrompt):
        req.chat.CopyFrom(
            pb.ChatPrompt(
                messages=[_message_to_proto(m) for m in prompt.messages],
                add_generation_prompt=prompt.add_generation_prompt,
                tools_json=json.dumps(prompt.tools, ensure_ascii=False) if prompt.tools else "",
            )
        )
    elif isinstance(prompt, InfillPrompt):
        req.infill.CopyFrom(pb.InfillPrompt(prefix=prompt.prefix, suffix=prompt.suffix))
    else:
        req.token_ids.CopyFrom(pb.TokenIds(ids=prompt))
    return req
