"""The body of `POST /v1/messages` (Anthropic's Messages API) as this frontend accepts it, and
its translation into a chat request, so that it runs on the chat path (chat template, tools,
sampling) and the same conversation gives the same tokens on both routes.

Content is text, tool_use (an assistant's calls) and tool_result (the user's answers to them);
any other block type, and any field not declared here, is a 400 naming it. `metadata.user_id`
is a label (the allow-list, docs/openai.md); `service_tier` only with values that ask for
nothing.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from frontend_svc.errors import bad_request
from frontend_svc.protocol import ChatCompletionRequest, ChatMessage, chat_request
from frontend_svc.tool_calling.models import FunctionCall, FunctionDefinition, Tool, ToolCall


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    citations: None = None  # what the SDK sends back of an answer's text block


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    # Told to the model as part of the result's text: the template has no other place.
    is_error: bool | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else _join(self.content)
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: str | None = None  # a label; the allow-list


class _Conversation(_Strict):
    """What both /v1/messages and /v1/messages/count_tokens take."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None

    def chat_messages(self) -> list[ChatMessage]:
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _join(self.system)
            out.append(ChatMessage(role="system", content=system))
        for i, m in enumerate(self.messages):
            out.extend(_chat_messages(m, f"messages[{i}]"))
        return out

    def chat_tools(self) -> dict[str, Any]:
        """tools, tool_choice and parallel_tool_calls as the chat request takes them."""
        if self.tools is None:
            if self.tool_choice is not None and self.tool_choice.type != "none":
                raise bad_request("tool_choice needs tools", "tool_choice")
            return {}
        tools = [
            Tool(
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.input_schema
                )
            )
            for t in self.tools
        ]
        choice: Any = None
        parallel = None
        if self.tool_choice is not None:
            c = self.tool_choice
            if (c.type == "tool") != (c.name is not None):
                raise bad_request('tool_choice.name is given with type "tool" only', "tool_choice")
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(c.type)
            if c.type == "tool":
                choice = {"type": "function", "function": {"name": c.name}}
            if c.disable_parallel_tool_use:
                parallel = False
        return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


class CountTokensRequest(_Conversation):
    pass


class MessagesRequest(_Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    timeout: float | None = None  # ours: seconds, as on chat (protocol.py)

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one runs as."""
        if self.max_tokens < 1:
            raise bad_request(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        return chat_request(
            model=self.model,
            messages=self.chat_messages(),
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stream=self.stream,
            **self.chat_tools(),
        )


def _join(blocks: list[TextBlock]) -> str:
    # As the chat path joins text parts.
    return "\n".join(b.text for b in blocks)


def _chat_messages(m: Message, where: str) -> list[ChatMessage]:
    """One Anthropic message as chat messages: an assistant's text and tool_use blocks are one
    message with tool_calls; a user's tool_result blocks are one "tool" message each, its text
    blocks one user message after them."""
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    texts = [b for b in m.content if isinstance(b, TextBlock)]
    if m.role == "assistant":
        if any(isinstance(b, ToolResultBlock) for b in m.content):
            raise bad_request("tool_result blocks belong in user messages", f"{where}.content")
        calls = [
            ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
            for b in m.content
            if isinstance(b, ToolUseBlock)
        ]
        return [ChatMessage(role="assistant", content=_join(texts), tool_calls=calls or None)]
    if any(isinstance(b, ToolUseBlock) for b in m.content):
        raise bad_request("tool_use blocks belong in assistant messages", f"{where}.content")
    out = [
        ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=b.text())
        for b in m.content
        if isinstance(b, ToolResultBlock)
    ]
    if texts or not out:
        out.append(ChatMessage(role="user", content=_join(texts)))
    return out
