"""The Python client's chat prompts with tools and tool messages, on the wire."""

from __future__ import annotations

import json

from client.params import SamplingParams
from client.prompts import ChatPrompt, build_request, normalize_prompts


def test_chat_prompts_carry_tools_and_tool_messages():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    tools = [{"type": "function", "function": {"name": "f"}}]
    (prompt,) = normalize_prompts(
        {
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "done"},
            ],
            "tools": tools,
        }
    )
    assert isinstance(prompt, ChatPrompt) and prompt.tools == tools
    chat = build_request(prompt, SamplingParams()).chat
    assert json.loads(chat.tools_json) == tools
    assert json.loads(chat.messages[1].tool_calls_json) == [call]
    assert (chat.messages[2].tool_call_id, chat.messages[2].name) == ("c1", "f")
    plain = build_request(ChatPrompt([{"role": "user", "content": "hi"}]), SamplingParams()).chat
    assert plain.tools_json == "" and plain.messages[0].tool_calls_json == ""
