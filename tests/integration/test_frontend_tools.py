"""Tool calling through the official openai client, against a real stack whose model writes
known texts (tests/support/tool_model.py: Hermes tool calls, text, or both; `logit_bias` picks
the script) behind a frontend started with `--enable-auto-tool-choice --tool-call-parser
hermes`.

tool_choice "auto" and "none", tool messages and streaming need nothing but this branch.
`required`, a named function and `beta.chat.completions.parse` are enforced by the scheduler's
grammar engine: they skip (saying so) while the scheduler does not honour structured outputs,
and must run once it does.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.support.frontend import openai_client, running_frontend
from tests.support.tool_model import HERMES_FRONTEND_ARGS, SCRIPTS, script_bias, tool_stack

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["Asia/Tokyo", "UTC"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llmserve_stack(tmp_path_factory):
    with tool_stack(tmp_path_factory.mktemp("tool-stack")) as stack:
        yield stack


@pytest.fixture(scope="module")
def frontend_args() -> list[str]:
    return [*HERMES_FRONTEND_ARGS]


@pytest.fixture(scope="module")
def tool_model_dir(llmserve_stack):
    return llmserve_stack.model_dir


@pytest.fixture(scope="module")
def vocab(tool_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tool_model_dir / "tokenizer.json"))


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_reads_a_call_from_the_text(oai, model):
    got = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=32)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")


def test_auto_text_and_parallel_calls(oai, model, vocab):
    got = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=32,
        logit_bias=script_bias(vocab, "text_then_two_calls"),
    )  # fmt: skip
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up."
    assert calls_of(choice.message) == [
        ("get_weather", {"city": "Tokyo"}),
        ("get_time", {"zone": "Asia/Tokyo"}),
    ]
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_auto_without_a_call_is_plain_content(oai, model, vocab):
    got = oai.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        max_tokens=32,
        logit_bias=script_bias(vocab, "plain_text"),
    )
    choice = got.choices[0]
    assert choice.message.content == "The weather is nice today."
    assert not choice.message.tool_calls and choice.finish_reason == "stop"


def test_tool_choice_none_reads_no_calls(oai, model):
    got = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=32
    )
    assert got.choices[0].message.content == "".join(SCRIPTS["single_call"])
    assert not got.choices[0].message.tool_calls and got.choices[0].finish_reason == "stop"


def _streamed(oai, kwargs: dict) -> tuple[str, dict, dict, str | None]:
    """(content, call names by index, argument fragments by index, finish reason) of one
    streamed answer, checking each tool-call delta's shape on the way."""
    content, calls, fragments, finish = "", {}, {}, None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # a call's first delta: id, type and name, no arguments
                assert tc.id.startswith("call_") and tc.type == "function"
                assert tc.function.name and tc.function.arguments == ""
                calls[tc.index], fragments[tc.index] = tc.function.name, []
            else:
                assert tc.id is None and tc.function.name is None
                fragments[tc.index].append(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, fragments, finish


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_streamed_calls_equal_the_whole_answer(oai, model, vocab, name):
    kwargs = dict(
        model=model, messages=ASK, tools=TOOLS, max_tokens=32, logit_bias=script_bias(vocab, name)
    )
    whole = oai.chat.completions.create(**kwargs).choices[0]
    # single_call's arguments span three tokens, so they arrive in several fragments unless the
    # stream merged those tokens' events into one (it does when the reader falls behind, as on
    # a loaded machine): a few tries, each checked whole, and one must show the fragments.
    most_fragments = 0
    for _ in range(4 if name == "single_call" else 1):
        content, calls, fragments, finish = _streamed(oai, kwargs)
        assert (content or None) == whole.message.content
        assert [(calls[i], json.loads("".join(fragments[i]))) for i in sorted(calls)] == (
            calls_of(whole.message)
        )
        assert finish == whole.finish_reason
        most_fragments = max(most_fragments, len(fragments.get(0, ())))
        if most_fragments >= 2:
            break
    if name == "single_call":
        assert most_fragments >= 2


def test_tool_messages_render_through_the_models_template(oai, model, frontend, tool_model_dir):
    first = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=32)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    status, body = frontend.request(
        "POST", "/tokenize", {"messages": messages, "tools": TOOLS, "add_generation_prompt": True}
    )
    assert status == 200, body
    hf = AutoTokenizer.from_pretrained(tool_model_dir)
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    want = hf.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True,
                                  tokenize=True, return_dict=False)  # fmt: skip
    assert body["tokens"] == list(want)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in hf.decode(want)
    again = oai.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=32)
    assert again.usage.prompt_tokens == len(want)
    assert again.choices[0].finish_reason == "tool_calls"


def test_auto_needs_a_parser(llmserve_stack, tmp_path_factory):
    with running_frontend(tmp_path_factory.mktemp("plain-frontend"), llmserve_stack.address) as fe:
        oai = openai_client(fe)
        model = oai.models.list().data[0].id
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4)
        assert e.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in e.value.body["message"]
        got = oai.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=32
        )
        assert got.choices[0].message.content == "".join(SCRIPTS["single_call"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(oai, model, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, **body)
    assert e.value.body["param"] == param


# ------------------------------------------------------------------ need grammar enforcement


@pytest.fixture(scope="module")
def enforced(oai, model, vocab) -> dict[str, float]:
    """Checks that the scheduler enforces structured outputs; then the
    logit_bias every constrained test uses: no whitespace and no script pieces, so that a
    model whose every other logit ties writes the shortest JSON its schema allows."""
    got = oai.completions.create(
        model=model, prompt="Yes or no?", max_tokens=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    # Enforcement is on main: an unconstrained answer here is a failure, never a skip.
    assert got.choices[0].text in ("yes", "no"), got.choices[0].text
    banned = [vocab.token_to_id(c) for c in "ĠĊĉč"]
    banned += [vocab.token_to_id(p) for s in SCRIPTS.values() for p in s]
    return {str(t): -100.0 for t in banned}


def test_required_makes_a_call(oai, model, enforced):
    got = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=96, logit_bias=enforced, temperature=0,
    )  # fmt: skip
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    ((name, args),) = calls_of(choice.message)
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    assert set(args) == set(schema["required"])
    for key, value in args.items():
        assert value in schema["properties"][key]["enum"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called(oai, model, enforced, stream):
    kwargs = dict(
        model=model, messages=ASK, tools=TOOLS, max_tokens=96, logit_bias=enforced,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0,
    )  # fmt: skip
    if not stream:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "stop"  # as OpenAI: a forced call ends as "stop"
        assert calls_of(choice.message) == [("get_time", {"zone": "Asia/Tokyo"})] or calls_of(
            choice.message
        ) == [("get_time", {"zone": "UTC"})]
        return
    name, args = None, ""
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            assert tc.index == 0
            name = name or tc.function.name
            args += tc.function.arguments or ""
    assert name == "get_time" and json.loads(args)["zone"] in ("Asia/Tokyo", "UTC")


class Weather(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


def test_parse_with_a_pydantic_model(oai, model, enforced):
    got = oai.chat.completions.parse(
        model=model, messages=ASK, response_format=Weather, max_tokens=64,
        logit_bias=enforced, temperature=0,
    )  # fmt: skip
    parsed = got.choices[0].message.parsed
    assert isinstance(parsed, Weather)
    assert Weather.model_validate_json(got.choices[0].message.content) == parsed


def test_parse_with_a_strict_tool(oai, model, enforced):
    tool = openai.pydantic_function_tool(Weather, name="report")
    got = oai.chat.completions.parse(
        model=model, messages=ASK, tools=[tool], max_tokens=64, logit_bias=enforced,
        tool_choice={"type": "function", "function": {"name": "report"}}, temperature=0,
    )  # fmt: skip
    call = got.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Weather)


def test_a_tool_schema_the_grammar_engine_rejects_names_tool_choice(oai, model, enforced):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=model, messages=ASK, tools=[bad], max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "f"}},
        )  # fmt: skip
    assert e.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_parallel_calls_reports_the_first(oai, model, vocab, stream):
    kwargs = dict(
        model=model, messages=ASK, tools=TOOLS, max_tokens=32, parallel_tool_calls=False,
        logit_bias=script_bias(vocab, "text_then_two_calls"),
    )  # fmt: skip
    if not stream:
        message = oai.chat.completions.create(**kwargs).choices[0].message
        assert calls_of(message) == [("get_weather", {"city": "Tokyo"})]
        return
    indexes = {
        tc.index
        for chunk in oai.chat.completions.create(**kwargs, stream=True)
        for tc in chunk.choices[0].delta.tool_calls or []
    }
    assert indexes == {0}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_holds_a_strict_tools_arguments_to_its_schema(oai, model, stream):
    """Under "auto" a strict tool's call is held to its parameters once the model starts it
    (a structural tag on the parser's <tool_call>): the model, which writes Paris, can only
    name Tokyo here. The non-strict tool beside it stays callable."""
    strict = json.loads(json.dumps(WEATHER))
    strict["function"]["strict"] = True
    strict["function"]["parameters"]["properties"]["city"]["enum"] = ["Tokyo"]
    # Greedy: past the forced arguments the model's logits are flat, and a sampled tail could
    # start a second call that max_tokens cuts off (whose text the parser then gives back).
    args = dict(model=model, messages=ASK, tools=[strict, TIME], max_tokens=48, temperature=0)
    if not stream:
        got = oai.chat.completions.create(**args)
        assert calls_of(got.choices[0].message) == [
            ("get_weather", {"city": "Tokyo", "unit": "celsius"})
        ]
        return
    arguments = ""
    for chunk in oai.chat.completions.create(**args, stream=True):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            arguments += call.function.arguments or ""
    assert json.loads(arguments) == {"city": "Tokyo", "unit": "celsius"}


def test_a_strict_tool_under_auto_needs_a_parser_that_can_hold_it(llmserve_stack, tmp_path):
    parser = ("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    with running_frontend(tmp_path, llmserve_stack.address, *parser) as fe:
        strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
        status, body = fe.request(
            "POST", "/v1/chat/completions", {"messages": ASK, "tools": [strict], "max_tokens": 4}
        )
        assert status == 400 and body["error"]["param"] == "tools"
        assert "llama3_json" in body["error"]["message"]


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_api_calls_tools_whole_and_streamed(oai, model):
    """The Responses API reads calls as the chat route does: a function_call item after the
    (empty) message; streamed, its events add up to the same item; the call's output goes
    back as a function_call_output item."""
    args = dict(model=model, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=48)
    whole = oai.responses.create(**args)
    assert [i.type for i in whole.output] == ["message", "function_call"]
    call = whole.output[1]
    assert (call.name, json.loads(call.arguments)) == (
        "get_weather", {"city": "Paris", "unit": "celsius"},
    )  # fmt: skip
    assert call.call_id.startswith("call_") and call.status == "completed"
    events = list(oai.responses.create(**args, stream=True))
    final = events[-1].response
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in whole.output
    ]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [i.id for i in final.output]
    assert done[1].call_id == final.output[1].call_id
    back = [
        *ASK,
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]  # fmt: skip
    again = oai.responses.create(
        model=model, input=back, tools=RESPONSES_TOOLS, max_output_tokens=48
    )
    chat = oai.chat.completions.create(
        model=model, tools=TOOLS, max_tokens=48,
        messages=[*ASK, {"role": "assistant", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
    )  # fmt: skip
    assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_api_tool_choice_and_text_format(oai, model):
    named = oai.responses.create(
        model=model, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_time"},
    )  # fmt: skip
    assert [(i.type, getattr(i, "name", None)) for i in named.output] == [
        ("message", None), ("function_call", "get_time"),
    ]  # fmt: skip
    assert json.loads(named.output[1].arguments)["zone"] in ("Asia/Tokyo", "UTC")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "ok", "schema": schema, "strict": True}
    got = oai.responses.create(model=model, input=ASK, text={"format": fmt}, max_output_tokens=64)
    assert set(json.loads(got.output_text)) == {"ok"}
    assert got.text.format.type == "json_schema"
