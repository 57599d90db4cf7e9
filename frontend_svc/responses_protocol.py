"""The body of `POST /v1/responses` (OpenAI's Responses API, text in and out) as this frontend
accepts it, and its translation into the chat path's messages and sampling parameters.

Unlike the chat and completions bodies, every field is checked: the Responses API has many
features a stateless text server cannot honour (stored responses, tools, reasoning, structured
output), and a client that asked for one must hear so rather than get plain text back. A field
sent as null, or with the one value that asks for nothing (`tools: []`, `background: false`,
`truncation: "disabled"`, ...), is accepted.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from client.params import SamplingParams
from frontend_svc.errors import bad_request
from frontend_svc.protocol import ChatCompletionRequest, ChatMessage

# Input roles -> the chat template's: OpenAI ranks `developer` instructions as `system` ones,
# and the templates we serve know only the latter.
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Content parts that carry plain text: the client's, and an earlier answer sent back as input.
_TEXT_PARTS = frozenset({"input_text", "output_text"})
# Keys of an input message besides role and content that change nothing here.
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
# Fields this frontend does not implement, with the values that ask for nothing of them.
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools, "auto" chooses none
    "parallel_tool_calls": (False, True),  # without tools there is nothing to call at all
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
            plain = key == "format" and (value is None or value == {"type": "text"})
            if not plain and value is not None:
                raise bad_request(
                    f"text.{key} is not supported by this server (only plain text output)",
                    f"text.{key}",
                )
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

    def messages(self) -> list[dict[str, str]]:
        """The chat messages: `instructions` as a system message first, then the input."""
        out = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise bad_request("input must not be empty", "input")
        for i, item in enumerate(self.input):
            out.append(_message(item, f"input[{i}]"))
        return out

    def to_params(self, max_model_len: int) -> SamplingParams:
        # The chat path's own translation, so that the same input samples the same way there.
        chat = ChatCompletionRequest(
            messages=[ChatMessage(role="user", content="")],
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
        )
        return chat.to_params(max_model_len)


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
