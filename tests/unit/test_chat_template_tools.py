"""Chat prompts with tools and tool messages render, through the whole conversion path
(client ChatPrompt -> GenerateRequest -> the scheduler's conversation), exactly as
transformers' own apply_chat_template renders them on the same tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from client.params import SamplingParams
from client.prompts import ChatPrompt, build_request, to_prompt
from scheduler_svc.api.convert import chat_from_proto, generate_input_from_proto
from scheduler_svc.core.sampling_params import ValidationError
from scheduler_svc.output.tokenizer import encode_chat, load_tokenizer, render_chat
from tests.support.tool_model import write_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
CALLS = [
    {"id": "call_a", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "14:05"},
    {"role": "assistant", "content": "Sunny, 21 C; it is 14:05."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-tokenizer")
    write_tokenizer(root)
    files = {p.name: p.read_bytes() for p in root.iterdir()}
    return load_tokenizer(files), AutoTokenizer.from_pretrained(root)


def hf_messages(messages: list[dict]) -> list[dict]:
    """What transformers' templates take: tool-call arguments as objects."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


@pytest.mark.parametrize("tools", [TOOLS, None])
@pytest.mark.parametrize("upto", [2, 3, 5, 7])
def test_rendering_equals_transformers(tokenizers, tools, upto):
    ours, hf = tokenizers
    messages = MESSAGES[:upto]
    req = build_request(ChatPrompt(messages, tools=tools), SamplingParams())
    conversation = generate_input_from_proto(req).chat
    want = hf.apply_chat_template(hf_messages(messages), tools=tools, tokenize=False,
                                  add_generation_prompt=True)  # fmt: skip
    assert render_chat(ours, conversation) == want
    want_ids = hf.apply_chat_template(hf_messages(messages), tools=tools, tokenize=True,
                                      add_generation_prompt=True, return_dict=False)  # fmt: skip
    assert encode_chat(ours, conversation) == list(want_ids)
    if tools:
        assert "<tools>" in want and '"get_weather"' in want
    if upto >= 3:
        assert '"arguments": {"city": "Paris"}' in want  # objects, not JSON text in a string


def test_the_wire_carries_tools_and_tool_fields():
    req = build_request(to_prompt({"messages": MESSAGES, "tools": TOOLS}), SamplingParams())
    assert json.loads(req.chat.tools_json) == TOOLS
    assistant, tool = req.chat.messages[2], req.chat.messages[3]
    assert json.loads(assistant.tool_calls_json) == CALLS and assistant.content == ""
    assert (tool.role, tool.tool_call_id, tool.name) == ("tool", "call_a", "get_weather")
    conversation = chat_from_proto(req.chat)
    assert conversation.tools == TOOLS
    assert conversation[2] == {"role": "assistant", "content": "", "tool_calls": CALLS}
    assert conversation[4] == {"role": "tool", "content": "14:05", "tool_call_id": "call_b"}


def test_bad_tool_json_is_invalid_argument():
    req = build_request(ChatPrompt(MESSAGES[:2]), SamplingParams())
    req.chat.tools_json = "{not json"
    with pytest.raises(ValidationError, match="tools_json is not valid JSON"):
        chat_from_proto(req.chat)
    req.chat.tools_json = '{"a": 1}'
    with pytest.raises(ValidationError, match="must be a JSON list of objects"):
        chat_from_proto(req.chat)


def test_bad_call_arguments_are_a_value_error(tokenizers):
    ours, _ = tokenizers
    call = {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    with pytest.raises(ValueError, match="tool call arguments must be JSON text"):
        render_chat(ours, messages)
