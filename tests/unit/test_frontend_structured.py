"""Request conversion: every response_format / structured_outputs / guided_* form becomes the
one StructuredOutput it asks for, tool_choice becomes its plan, and conflicts are 400s naming
the field."""

from __future__ import annotations

import json

import pytest

from client.structured import StructuredOutput
from frontend_svc.errors import APIError
from frontend_svc.protocol import ChatCompletionRequest, CompletionRequest
from frontend_svc.tool_calling.protocol import ToolConfig

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                       "$defs": {"City": {"enum": ["Paris", "Tokyo"]}}},
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}
AUTO = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def chat_so(**body) -> StructuredOutput | None:
    req = ChatCompletionRequest(messages=MESSAGES, **body)
    return req.to_params(64, req.plan(AUTO)).structured_output


def completion_so(**body) -> StructuredOutput | None:
    return CompletionRequest(prompt="x", **body).to_params().structured_output


def error_of(fn, **body) -> APIError:
    with pytest.raises(APIError) as e:
        fn(**body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("fn", [chat_so, completion_so])
@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", True)),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
            StructuredOutput("json_schema", json.dumps(SCHEMA)),
        ),
        (
            {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<f"]}},
            StructuredOutput("structural_tag", json.dumps(
                {"type": "structural_tag", "structures": [], "triggers": ["<f"]})),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput("json_schema", json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput("choice", ["a", "b"])),
        ({"structured_outputs": {"grammar": "start: /x+/"}}, StructuredOutput("grammar", "start: /x+/")),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", True)),
        (
            {"structured_outputs": {"structural_tag": {"structures": []}}},
            StructuredOutput("structural_tag", '{"structures": []}'),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
        ({"guided_regex": "\\d+"}, StructuredOutput("regex", "\\d+")),
        ({"guided_choice": ["x", "y"]}, StructuredOutput("choice", ["x", "y"])),
        ({"guided_grammar": "root ::= 'a'"}, StructuredOutput("grammar", "root ::= 'a'")),
    ],
)  # fmt: skip
def test_each_form_is_one_structured_output(fn, body, want):
    assert fn(**body) == want


def test_the_constraint_reaches_the_wire_message():
    msg = CompletionRequest(prompt="x", guided_choice=["x", "y"]).to_params().to_proto()
    assert list(msg.structured_output.choice.choices) == ["x", "y"]
    assert msg.structured_output.WhichOneof("kind") == "choice"
    assert not CompletionRequest(prompt="x").to_params().to_proto().HasField("structured_output")


@pytest.mark.parametrize("fn", [chat_so, completion_so])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
        ({"guided_choice": ["a"], "guided_grammar": "x"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json"),
        ({"guided_json": "nope"}, "guided_json"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": "{bad"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ],
)  # fmt: skip
def test_conflicts_and_bad_constraints_are_400s_naming_the_field(fn, body, param):
    assert error_of(fn, **body).param == param


def test_unknown_structured_outputs_options_are_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="whitespace_pattern"):
        CompletionRequest(prompt="x", structured_outputs={"regex": "a", "whitespace_pattern": " "})


# ------------------------------------------------------------------ tool_choice


def plan(config: ToolConfig = AUTO, **body):
    req = ChatCompletionRequest(messages=MESSAGES, **body)
    p = req.plan(config)
    return p, req.to_params(64, p)


def test_tools_default_to_auto_with_the_configured_parser():
    p, params = plan(tools=[WEATHER])
    assert p.mode == "auto" and p.parser is not None and p.parser.name == "hermes"
    assert params.structured_output is None
    assert params.skip_special_tokens is False  # hermes reads <tool_call> even where special
    assert p.tools == [WEATHER]


def test_auto_without_a_parser_is_a_400_as_in_vllm():
    for config in (ToolConfig(), ToolConfig(tool_call_parser="hermes")):
        err = error_of(plan, config=config, tools=[WEATHER])
        assert err.param == "tool_choice" and "--enable-auto-tool-choice" in err.message
    p, params = plan(config=ToolConfig(), tools=[WEATHER], tool_choice="none")
    assert p.mode == "none" and p.tools == [WEATHER] and p.parser is None


def test_required_is_a_list_of_calls_with_defs_hoisted():
    p, params = plan(tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(params.structured_output.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"City": {"enum": ["Paris", "Tokyo"]}}
    weather, time = schema["items"]["anyOf"]
    assert weather["properties"]["name"] == {"type": "string", "const": "get_weather"}
    assert weather["properties"]["parameters"]["properties"]["city"] == {"$ref": "#/$defs/City"}
    assert "$defs" not in weather["properties"]["parameters"]
    assert time["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert weather["required"] == ["name", "parameters"]
    _, one = plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(one.structured_output.value)["maxItems"] == 1


def test_conflicting_defs_are_a_400():
    other = json.loads(json.dumps(WEATHER))
    other["function"]["name"] = "other"
    other["function"]["parameters"]["$defs"]["City"] = {"type": "string"}
    assert error_of(plan, tools=[WEATHER, other], tool_choice="required").param == "tools"


def test_a_named_function_is_held_to_its_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    p, params = plan(tools=[WEATHER, TIME], tool_choice=named)
    assert p.mode == "named"
    want = WEATHER["function"]["parameters"]
    assert json.loads(params.structured_output.value) == want
    missing = {"type": "function", "function": {"name": "nope"}}
    assert "nope" in error_of(plan, tools=[WEATHER], tool_choice=missing).message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_json": SCHEMA}, "tool_choice"),
        ({"functions": [WEATHER["function"]]}, "functions"),
    ],
)
def test_tool_choice_errors(body, param):
    assert error_of(plan, **body).param == param


def test_messages_carry_tool_calls_and_tool_results():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    chat = req.chat(req.plan(AUTO))
    assert chat.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert chat.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert chat.tools == [WEATHER]
