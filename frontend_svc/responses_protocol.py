"""The body of `POST /v1/responses` (OpenAI's Responses API, text in and out) as this frontend
accepts it, and its translation into the chat path's messages and sampling parameters.

Every field is checked: the Responses API has many features a stateless server cannot honour
(stored responses, built-in tools, background runs), and a client that asked for one must hear
so rather than get plain text back. A field sent as null, or with the one value that asks for
nothing (`background: false`, `truncation: "disabled"`, ...), is accepted. Function tools,
`tool_choice`, `parallel_tool_calls` and `text.format` (json_object, json_schema) run through
the chat path's machinery; input items may be messages, function calls, their outputs, and
reasoning items (handed to the next assistant message as its reasoning).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from client.params import SamplingParams
from frontend_svc import features
from frontend_svc.errors import bad_request
from frontend_svc.protocol import ChatCompletionRequest, chat_request

# Input roles -> the chat template's: OpenAI ranks `developer` instructions as `system` ones,
# and the templates we serve know only the latter.
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Content parts that carry plain text: the client's, and an earlier answer sent back as input.
_TEXT_PARTS = frozenset({"input_text", "output_text"})
# Keys of an input message besides role and content that change nothing here.
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
# Fields this frontend does not implement, with the values that ask for nothing of them.
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "include": ([],),
    "background": (False,),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
}
# OpenAI's limits on metadata (16 pairs, keys up to 64 characters, values up to 512).
_MAX_METADATA = 16


class ResponsesRequest(BaseModel):
    # Extra fields are kept so that `check_supported` can name them in its 400.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    timeout: float | None = None  # seconds; as on chat (protocol.py)

    def check_supported(self) -> None:
        """400 naming the first field asking for something this server does not do."""
        if self.store:
            raise bad_request(
                "store=true is not supported: this server keeps no responses (send store=false)",
                "store",
            )
        for name, value in (self.model_extra or {}).items():
            if value is None or value in _NOOP_VALUES.get(name, ()):
                continue
            raise bad_request(f"{name} is not supported by this server", name)
        for key, value in (self.text or {}).items():
            if key != "format" and value is not None:
                raise bad_request(f"text.{key} is not supported by this server", f"text.{key}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise bad_request(
                f"max_output_tokens must be >= 1, got {self.max_output_tokens}",
                "max_output_tokens",
            )
        meta = self.metadata or {}
        if len(meta) > _MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
            raise bad_request(
                "metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters",
                "metadata",
            )

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages: `instructions` as a system message first, then the input."""
        out = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise bad_request("input must not be empty", "input")
        reasoning: list[str] = []  # reasoning items waiting for their assistant message
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind in _ITEMS:
                _ITEMS[kind](out, reasoning, _checked(item, kind, where))
                continue
            message = _message(item, where)
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
                reasoning.clear()
            out.append(message)
        return out

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one runs as, so that the same input samples the same way."""
        return chat_request(
            model=self.model,
            messages=self.messages(),
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            tools=_chat_tools(self.tools),
            tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls,
            **features.responses_fields(self),
        )

    def to_params(self, max_model_len: int) -> SamplingParams:
        return self.to_chat().to_params(max_model_len)


# Fields of the non-message input items, by type.
_ITEM_KEYS = {
    "function_call": ({"call_id", "name", "arguments"}, {"type", "id", "status"}),
    "function_call_output": ({"call_id", "output"}, {"type", "id", "status"}),
    "reasoning": (set(), {"type", "id", "summary", "content", "encrypted_content", "status"}),
}


def _checked(item: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    required, optional = _ITEM_KEYS[kind]
    for key in item.keys() - required - optional:
        raise bad_request(f"{where}.{key} is not supported by this server", f"{where}.{key}")
    for key in required - item.keys():
        raise bad_request(f"{where} ({kind}) needs {key}", f"{where}.{key}")
    if item.get("encrypted_content"):
        raise bad_request(
            f"{where}.encrypted_content cannot be read by this server", f"{where}.encrypted_content"
        )
    return item


def _function_call(out: list[dict[str, Any]], reasoning: list[str], item: dict[str, Any]) -> None:
    # Calls in a row (after the assistant's text, if any) are one assistant message's calls.
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
        return
    message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
        reasoning.clear()
    out.append(message)


def _call_output(out: list[dict[str, Any]], _: list[str], item: dict[str, Any]) -> None:
    output = item["output"]
    if not isinstance(output, str):
        raise bad_request("function_call_output.output must be a string", "input")
    out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})


def _reasoning(_: list[dict[str, Any]], reasoning: list[str], item: dict[str, Any]) -> None:
    for part in item.get("content") or []:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            reasoning.append(part["text"])


_ITEMS = {
    "function_call": _function_call,
    "function_call_output": _call_output,
    "reasoning": _reasoning,
}


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape (the Responses API's are flat)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}].type {str(tool.get('type'))[:32]!r} is not supported (only "
                "function tools)",
                f"tools[{i}].type",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": function})
    return out or None


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be none, auto, required or a function", "tool_choice")


def _message(item: Any, where: str) -> dict[str, str]:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be a message object", where)
    kind = item.get("type", "message")
    if kind != "message":
        raise bad_request(
            f"{where}.type {str(kind)[:32]!r} is not supported (only text messages)",
            f"{where}.type",
        )
    for key in item.keys() - _MESSAGE_KEYS:
        raise bad_request(f"{where}.{key} is not supported by this server", f"{where}.{key}")
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(
            f"{where}.role must be one of {', '.join(sorted(_ROLES))}, got {str(role)[:32]!r}",
            f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of parts", f"{where}.content"
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"{at}.type {str(kind)[:32]!r} is not supported (only input_text parts)",
                f"{at}.type",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{at}.text must be a string", f"{at}.text")
        texts.append(part["text"])
    # Joined as the chat path joins its text parts.
    return {"role": _ROLES[role], "content": "\n".join(texts)}
