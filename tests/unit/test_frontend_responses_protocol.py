"""The Responses API body's translation (frontend_svc/responses_protocol.py), the objects and
events made of its output (responses_api.py), and best_of's choice among candidates
(logprobs.py), without a server."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from frontend_svc.errors import APIError
from frontend_svc.logprobs import best_candidates
from frontend_svc.responses_api import ResponseEvents, ResponseOutput
from frontend_svc.responses_protocol import ResponsesRequest
from frontend_svc.tool_calling.protocol import ToolConfig


def make_request(**fields) -> ResponsesRequest:
    return ResponsesRequest(**{"input": "Hi", **fields})


def test_best_candidates_are_ranked_within_each_prompt():
    # Two prompts, best_of=3: candidates 0-2 belong to prompt 0, 3-5 to prompt 1.
    scores = {0: -5.0, 1: -1.0, 2: -3.0, 3: -2.0, 4: -2.0, 5: -9.0}
    assert best_candidates(scores, num_prompts=2, best_of=3, n=2) == [1, 2, 3, 4]
    assert best_candidates(scores, num_prompts=2, best_of=3, n=1) == [1, 3]  # a tie: lower index


def test_instructions_then_string_input():
    req = make_request(instructions="Be brief.")
    assert req.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_message_items_with_text_parts_and_developer_role():
    req = make_request(
        input=[
            {"role": "developer", "content": "Rules"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"},
            ]},
            {"role": "assistant", "content": [
                {"type": "output_text", "text": "c", "annotations": []},
            ]},
        ]
    )  # fmt: skip
    assert req.messages() == [
        {"role": "system", "content": "Rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
    ]


def test_params_follow_the_chat_path():
    params = make_request(max_output_tokens=7, temperature=0.5, top_p=0.9).to_params(128)
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (7, 0.5, 0.9, 1)
    assert make_request().to_params(128).max_tokens == 128  # no limit: the model's length


@pytest.mark.parametrize(
    "fields",
    [
        {"store": False},
        {"tools": [], "tool_choice": "none", "include": [], "background": False},
        {"truncation": "disabled", "previous_response_id": None, "reasoning": None},
        {"text": {"format": {"type": "text"}}},
    ],
)
def test_fields_asking_for_nothing_are_accepted(fields):
    make_request(**fields).check_supported()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_fields_asking_for_more_are_refused_by_name(fields, param):
    with pytest.raises(APIError) as e:
        make_request(**fields).check_supported()
    assert e.value.status == 400 and e.value.param == param


def test_bad_input_items_are_named():
    with pytest.raises(APIError) as e:
        make_request(input=[{"role": "user", "content": "x"}, "loose text"]).messages()
    assert e.value.param == "input[1]"
    with pytest.raises(APIError) as e:
        make_request(input=[{"role": "user", "content": "x", "name": "bob"}]).messages()
    assert e.value.param == "input[0].name"
    with pytest.raises(APIError) as e:
        make_request(input=[{"role": "user", "content": [{"type": "input_text"}]}]).messages()
    assert e.value.param == "input[0].content[0].text"


def _output(finish_reason: str | None = None) -> ResponseOutput:
    run = SimpleNamespace(num_prompt_tokens=5, streams=[SimpleNamespace(forwarded=[2])])
    req = make_request()
    out = ResponseOutput(req, req.to_params(64), run, "resp_x", "msg_x", model="m")  # type: ignore[arg-type]
    out.finish_reason = finish_reason
    return out


@pytest.mark.parametrize(
    ("finish_reason", "status", "message_status", "last_event"),
    [
        ("stop", "completed", "completed", "response.completed"),
        ("length", "incomplete", "incomplete", "response.incomplete"),
        ("abort", "cancelled", "incomplete", "response.incomplete"),
        ("error", "failed", "incomplete", "response.failed"),
    ],
)
def test_finish_reasons_map_to_response_statuses(finish_reason, status, message_status, last_event):
    out = _output(finish_reason)
    body = out.response()
    assert body["status"] == status and body["output"][0]["status"] == message_status
    assert (body["error"] is not None) == (status == "failed")
    assert body["usage"]["total_tokens"] == 7
    events = ResponseEvents(out)
    events.sequence_number = 5  # the opening events were sent
    sent = asyncio.run(events.of(None, None))
    assert sent[-1].startswith(f"event: {last_event}\n")
    # No text came: the end opens and closes the (empty) message item before the last event.
    assert len(sent) == 6 and "response.output_item.added" in sent[0]
    # A scheduler error mid-stream is an `error` event, numbered after the others.
    (err,) = events.error(APIError(503, "no executor", type="service_unavailable"))
    name, data = err.strip().split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "sequence_number": 5 + len(sent), "code": "503", "message": "no executor",
        "param": None,
    }  # fmt: skip


def test_tools_tool_choice_and_text_format_become_the_chat_requests():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    chat = make_request(
        tools=[tool], tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
        text={"format": fmt},
    ).to_chat()  # fmt: skip
    assert chat.tools[0].function.name == "f" and chat.tools[0].function.strict is True
    assert chat.tool_choice.function.name == "f" and chat.parallel_tool_calls is False
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    with pytest.raises(APIError) as e:  # tool_choice without tools, as on the chat route
        make_request(tool_choice="required").to_chat().plan(ToolConfig())
    assert e.value.param == "tool_choice"


def test_function_calls_their_outputs_and_reasoning_items_become_messages():
    req = make_request(
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Look it up."}]},
            {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "t", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
    )  # fmt: skip
    call = {"type": "function", "function": {"name": "w", "arguments": "{}"}, "id": "call_1"}
    assert req.messages() == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
         "tool_calls": [call, {**call, "id": "call_2", "function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
