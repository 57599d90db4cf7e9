"""The Python client's structured outputs and tool-carrying chat prompts on the wire."""

from __future__ import annotations

import json

import pytest

from client.params import SamplingParams
from client.prompts import ChatPrompt, build_request, normalize_prompts
from client.structured import StructuredOutput


@pytest.mark.parametrize(
    ("so", "kind", "value"),
    [
        (StructuredOutput(json_schema={"type": "object"}), "json_schema", '{"type": "object"}'),
        (StructuredOutput(json_schema='{"type": "integer"}'), "json_schema", '{"type": "integer"}'),
        (StructuredOutput(json_object=True), "json_object", True),
        (StructuredOutput(regex="a+"), "regex", "a+"),
        (StructuredOutput(grammar="start: /x/"), "grammar", "start: /x/"),
        (StructuredOutput(structural_tag={"a": 1}), "structural_tag", '{"a": 1}'),
    ],
)
def test_each_kind_on_the_wire(so, kind, value):
    msg = SamplingParams(structured_output=so).to_proto()
    assert msg.structured_output.WhichOneof("kind") == kind
    assert getattr(msg.structured_output, kind) == value
    back = SamplingParams.from_proto(msg).structured_output
    assert back is not None and back.to_proto() == msg.structured_output


def test_choice_and_no_constraint():
    msg = SamplingParams(structured_output=StructuredOutput(choice=["a", "b"])).to_proto()
    assert list(msg.structured_output.choice.choices) == ["a", "b"]
    assert SamplingParams.from_proto(msg).structured_output == StructuredOutput(choice=("a", "b"))
    assert SamplingParams.from_proto(SamplingParams().to_proto()).structured_output is None


@pytest.mark.parametrize("kwargs", [{}, {"regex": "a", "choice": ["a"]}, {"json_object": False}])
def test_exactly_one_kind(kwargs):
    with pytest.raises(ValueError, match="exactly one kind"):
        StructuredOutput(**kwargs)


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
