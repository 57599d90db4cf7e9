"""The field walk of test_frontend_fields.py, one level down: every field of the objects inside
a request (chat messages and their parts and calls, tools, response formats, and the Messages
API's messages, blocks, tools and tool_choice) is honoured (a value of it changes the prompt
or the answer), validated (a 4xx naming it), a label on the allow-list, or handed to the chat
template (docs/openai.md says which), never accepted and dropped on the way."""

from __future__ import annotations

import json

import pytest

from frontend_svc.anthropic_protocol import (
    AnthropicTool,
    Message,
    Metadata,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from frontend_svc.protocol import ChatMessage, TextPart
from frontend_svc.structured.fields import JsonSchemaFormat, ResponseFormat
from frontend_svc.tool_calling.models import FunctionCall, FunctionDefinition, Tool, ToolCall
from tests.integration.test_frontend_fields import (  # noqa: F401 - the fixtures
    DOCS,
    LABEL,
    _normal,
    frontend_args,
    llmserve_stack,
    vocab,
)

TEMPLATE = "template"  # handed to the chat template, which decides what it renders
HI = {"role": "user", "content": "Hi"}
FN = {"name": "f", "parameters": {"type": "object"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOLS = [{"type": "function", "function": FN}]


def _msgs(*extra: dict) -> dict:
    return {"messages": [HI, *extra]}


def _assistant(**fields) -> dict:
    return _msgs({"role": "assistant", "content": "", **fields})


def _call(**fields) -> dict:
    return _assistant(tool_calls=[{**CALL, **fields}])


def _fn(**fields) -> dict:
    return _call(function={**CALL["function"], **fields})


def _tool(**fields) -> dict:
    return {"messages": [HI], "tools": [{"type": "function", "function": {**FN, **fields}}]}


def _format(**fields) -> dict:
    schema = {"name": "x", "schema": {"type": "object"}, **fields}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _claude(*content: dict, role: str = "user") -> dict:
    return {"messages": [{"role": role, "content": list(content)}]}


USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
ATOOL = {"name": "f", "input_schema": {"type": "object"}}


def _turns(**result) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [USE]},
            {"role": "user", "content": [{**RESULT, **result}]},
        ]
    }


# (model, route, base body, {field: (base body, probe body) | LABEL | TEMPLATE})
WALKS = [
    (ChatMessage, "/tokenize", {
        "role": (_msgs(), {"messages": [{"role": "system", "content": "Hi"}]}),
        "content": (_msgs(), {"messages": [{"role": "user", "content": "Other"}]}),
        "name": TEMPLATE,
        "tool_calls": (_assistant(), _call()),
        "tool_call_id": TEMPLATE,
        "reasoning_content": TEMPLATE,
        "refusal": (_msgs(), _assistant(refusal="no")),
        "audio": (_msgs(), _assistant(audio={"id": "a"})),
        "function_call": (_msgs(), _assistant(function_call={"name": "f"})),
        "annotations": (_msgs(), _assistant(annotations=[{"type": "url_citation"}])),
    }),
    (TextPart, "/tokenize", {
        "type": (_msgs(), {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        "text": (_msgs(), {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Other"}]}]}),
    }),
    (ToolCall, "/tokenize", {
        "id": TEMPLATE,
        "type": (_call(), _call(type="custom")),
        "function": (_call(), _fn(name="g")),
    }),
    (FunctionCall, "/tokenize", {
        "name": (_call(), _fn(name="g")),
        "arguments": (_call(), _fn(arguments='{"a": 1}')),
    }),
    (Tool, "/tokenize", {
        "type": (_tool(), {"messages": [HI], "tools": [{"type": "custom", "function": FN}]}),
        "function": (_tool(), _tool(name="g")),
    }),
    (FunctionDefinition, "/tokenize", {
        "name": (_tool(), _tool(name="g")),
        "description": (_tool(), _tool(description="Does f")),
        "parameters": (_tool(), _tool(parameters={"type": "object", "properties": {}})),
        "strict": (_tool(), _tool(strict=True)),
    }),
    (ResponseFormat, "/v1/chat/completions", {
        "type": (_msgs(), {**_msgs(), "response_format": {"type": "json_object"}}),
        "json_schema": (_msgs(), {**_msgs(), **_format()}),
    }),
    (JsonSchemaFormat, "/v1/chat/completions", {
        "name": LABEL,
        "description": LABEL,
        "schema_": ({**_msgs(), **_format()}, {**_msgs(), **_format(schema={"enum": ["a"]})}),
        "strict": LABEL,
    }),
    (Message, "/v1/messages/count_tokens", {
        "role": ({"messages": [HI]}, {"messages": [{"role": "system", "content": "Hi"}]}),
        "content": ({"messages": [HI]}, {"messages": [{"role": "user", "content": "Other"}]}),
    }),
    (TextBlock, "/v1/messages/count_tokens", {
        "type": (_claude({"type": "text", "text": "Hi"}), _claude({"type": "image", "text": "Hi"})),
        "text": (_claude({"type": "text", "text": "Hi"}), _claude({"type": "text", "text": "Something else"})),
        "citations": (_claude({"type": "text", "text": "Hi"}),
                      _claude({"type": "text", "text": "Hi", "citations": [{}]})),
    }),
    (ToolUseBlock, "/v1/messages/count_tokens", {
        "type": (_turns(), {"messages": [HI, {"role": "assistant", "content": [
            {**USE, "type": "server_tool_use"}]}]}),
        "id": TEMPLATE,
        "name": (_turns(), {"messages": [HI, {"role": "assistant", "content": [
            {**USE, "name": "g"}]}]}),
        "input": (_turns(), {"messages": [HI, {"role": "assistant", "content": [
            {**USE, "input": {"a": 1}}]}, {"role": "user", "content": [RESULT]}]}),
    }),
    (ToolResultBlock, "/v1/messages/count_tokens", {
        "type": (_turns(), _turns(type="web_search_tool_result")),
        "tool_use_id": TEMPLATE,
        "content": (_turns(), _turns(content="not ok")),
        "is_error": (_turns(), _turns(is_error=True)),
    }),
    (AnthropicTool, "/v1/messages/count_tokens", {
        "name": ({**_msgs(), "tools": [ATOOL]}, {**_msgs(), "tools": [{**ATOOL, "name": "get_the_weather"}]}),
        "description": ({**_msgs(), "tools": [ATOOL]},
                        {**_msgs(), "tools": [{**ATOOL, "description": "Does f"}]}),
        "input_schema": ({**_msgs(), "tools": [ATOOL]}, {**_msgs(), "tools": [
            {**ATOOL, "input_schema": {"type": "object", "properties": {}}}]}),
        "type": ({**_msgs(), "tools": [ATOOL]},
                 {**_msgs(), "tools": [{**ATOOL, "type": "bash_20250124"}]}),
    }),
    (ToolChoice, "/v1/messages", {
        "type": ({**_msgs(), "tools": [ATOOL]},
                 {**_msgs(), "tools": [ATOOL], "tool_choice": {"type": "none"}}),
        "name": ({**_msgs(), "tools": [ATOOL]},
                 {**_msgs(), "tools": [ATOOL], "tool_choice": {"type": "auto", "name": "f"}}),
        # One call at most: with this model's single call nothing shows; its type is checked.
        "disable_parallel_tool_use": ({**_msgs(), "tools": [ATOOL]}, {
            **_msgs(), "tools": [ATOOL],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": "sometimes"}}),
    }),
    (Metadata, "/v1/messages", {"user_id": LABEL}),
]  # fmt: skip
CASES = [(m, path, f) for m, path, _ in WALKS for f in m.model_fields]


def _body(path: str, body: dict, model: str) -> dict:
    if path.startswith("/v1/messages"):
        return {"model": model, **({"max_tokens": 8} if path == "/v1/messages" else {}), **body}
    if path == "/v1/chat/completions":
        return {"max_tokens": 8, "temperature": 0, **body}
    return body


@pytest.mark.parametrize(("model", "path", "field"), CASES,
                         ids=[f"{m.__name__}.{f}" for m, _, f in CASES])  # fmt: skip
def test_every_nested_field_is_honoured_validated_labelled_or_templated(
    frontend,  # noqa: F811 - the imported fixture
    model,
    path,
    field,
):
    probes = next(p for m, _, p in WALKS if m is model)
    assert field in probes, f"{model.__name__}.{field} has no probe: say how it is honoured"
    probe = probes[field]
    if probe in (LABEL, TEMPLATE):
        assert f"`{field.rstrip('_')}`" in DOCS.read_text(), f"{field} is not documented"
        return
    name = frontend.request("GET", "/v1/models")[1]["data"][0]["id"]
    status0, body0 = frontend.request("POST", path, _body(path, probe[0], name))
    assert status0 == 200, body0
    status, body = frontend.request("POST", path, _body(path, probe[1], name))
    if status == 200:
        assert _normal(body) != _normal(body0), f"{field}: {probe[1]} changed nothing"
    else:
        assert status in (400, 404), body
        assert field.rstrip("_") in json.dumps(body), body
