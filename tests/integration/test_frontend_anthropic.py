"""Anthropic's Messages API (/v1/messages) through the official `anthropic` SDK, against a real
stack whose model writes known texts (tests/support/tool_model.py; unbiased, it writes a Hermes
call of get_weather). Every answer is checked against the chat route's for the same
conversation: the two routes run the same prompt the same way."""

from __future__ import annotations

import anthropic
import pytest

from tests.support.frontend import openai_client, running_frontend
from tests.support.tool_model import HERMES_FRONTEND_ARGS, SCRIPTS, tool_stack

KEY = "sk-anthropic-test"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}
SCRIPT_TEXT = "".join(SCRIPTS["single_call"])


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic")
    keys = tmp / "keys"
    keys.write_text(f"{KEY} tests\n")
    with (
        tool_stack(tmp) as stack,
        running_frontend(
            tmp / "frontend", stack.address, "--api-key-file", str(keys), *HERMES_FRONTEND_ARGS
        ) as fe,
    ):
        yield fe


@pytest.fixture(scope="module")
def claude(frontend):
    return anthropic.Anthropic(base_url=frontend.base_url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(frontend):
    return openai_client(frontend, KEY)


def test_a_text_message_equals_the_chat_answer(claude, oai, model):
    # This SDK has no sampling keywords any more; the API still takes them in the body.
    got = claude.messages.create(
        model=model, max_tokens=64, system="Be brief.", messages=ASK,
        extra_body={"temperature": 0, "top_k": 1, "top_p": 1.0},
    )  # fmt: skip
    want = oai.chat.completions.create(
        model=model, max_tokens=64, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
    )  # fmt: skip
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want.choices[0].message.content == SCRIPT_TEXT
    assert got.stop_reason == "end_turn" and got.stop_sequence is None
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.usage.output_tokens == want.usage.completion_tokens


def test_multi_turn_blocks_and_max_tokens(claude, oai, model):
    turns = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}]},
        {"role": "user", "content": [{"type": "text", "text": "Go"}, {"type": "text", "text": "on"}]},
    ]  # fmt: skip
    got = claude.messages.create(model=model, max_tokens=2, messages=turns)
    want = oai.chat.completions.create(
        model=model, max_tokens=2,
        messages=[*ASK, {"role": "assistant", "content": "Let me see."},
                  {"role": "user", "content": "Go\non"}],
    )  # fmt: skip
    assert got.stop_reason == "max_tokens" and got.usage.output_tokens == 2
    assert got.content[0].text == want.choices[0].message.content
    assert got.usage.input_tokens == want.usage.prompt_tokens


def test_stop_sequences_end_the_answer(claude, model):
    got = claude.messages.create(
        model=model, max_tokens=64, messages=ASK, stop_sequences=["nope", "Paris"]
    )
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == "Paris"
    assert got.content[0].text == SCRIPT_TEXT[: SCRIPT_TEXT.index("Paris")]


def test_a_streamed_message_has_anthropics_events_and_equals_the_whole(claude, frontend, model):
    whole = claude.messages.create(model=model, max_tokens=64, messages=ASK)
    body = {"model": model, "max_tokens": 64, "messages": ASK, "stream": True}
    status, raw = frontend.request("POST", "/v1/messages", body, {"x-api-key": KEY})
    assert status == 200
    names = [line[len("event: ") :] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    # The SDK's iterator leaves the pings out.
    events = list(claude.messages.create(model=model, max_tokens=64, messages=ASK, stream=True))
    kinds = [e.type for e in events]
    # (How many deltas a stream has depends on how tokens were grouped into steps.)
    assert _runs(kinds) == _runs([n for n in names if n != "ping"])
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with claude.messages.stream(model=model, max_tokens=64, messages=ASK) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip_equals_the_chat_route(claude, oai, model, stream):
    if stream:
        with claude.messages.stream(model=model, max_tokens=64, messages=ASK, tools=[WEATHER]) as s:
            first = s.get_final_message()
    else:
        first = claude.messages.create(model=model, max_tokens=64, messages=ASK, tools=[WEATHER])
    chat = oai.chat.completions.create(
        model=model, max_tokens=64, messages=ASK, tools=[CHAT_WEATHER]
    )
    assert first.stop_reason == "tool_use" and chat.choices[0].finish_reason == "tool_calls"
    (use,) = first.content
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    assert (use.name, use.input) == ("get_weather", {"city": "Paris", "unit": "celsius"})
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    # The result goes back; the prompt is the chat route's with the call and a tool message.
    turns = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
    ]  # fmt: skip
    second = claude.messages.create(model=model, max_tokens=64, messages=turns, tools=[WEATHER])
    call = chat.choices[0].message
    chat_turns = [
        *ASK,
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    again = oai.chat.completions.create(
        model=model, max_tokens=64, messages=chat_turns, tools=[CHAT_WEATHER]
    )
    assert second.usage.input_tokens == again.usage.prompt_tokens > first.usage.input_tokens
    count = claude.messages.count_tokens(model=model, messages=turns, tools=[WEATHER])
    assert count.input_tokens == second.usage.input_tokens


def test_tool_choice_none_and_named(claude, model):
    none = claude.messages.create(
        model=model, max_tokens=64, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert [b.type for b in none.content] == ["text"] and none.content[0].text == SCRIPT_TEXT
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=model, max_tokens=8, messages=ASK, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "nope"},
        )  # fmt: skip
    assert "nope" in e.value.body["error"]["message"]


def test_count_tokens_is_the_messages_input(claude, model):
    system = [{"type": "text", "text": "Be brief."}]
    got = claude.messages.count_tokens(model=model, messages=ASK, system=system)
    made = claude.messages.create(model=model, max_tokens=1, messages=ASK, system=system)
    assert got.input_tokens == made.usage.input_tokens > 0


def _blocks(message) -> list[tuple]:
    """A message's blocks as (type, text or (name, input)), ids and SDK classes aside."""
    return [
        (b.type, b.text if b.type == "text" else (b.name, b.input) if b.type == "tool_use" else b)
        for b in message.content
    ]


def _runs(names: list[str]) -> list[str]:
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def _error(e: anthropic.APIStatusError) -> dict:
    assert e.body["type"] == "error"
    return e.body["error"]


@pytest.mark.parametrize(
    ("extra", "kind", "words"),
    [
        ({"max_tokens": 0}, "invalid_request_error", "max_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "invalid_request_error",
         "thinking"),
        ({"temperature": 1.5}, "invalid_request_error", "temperature"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
         "invalid_request_error", "image"),
        ({"model": "claude-nope"}, "not_found_error", "claude-nope"),
    ],
)  # fmt: skip
def test_bad_requests_are_errors_in_anthropics_shape(frontend, model, extra, kind, words):
    body = {"model": model, "max_tokens": 8, "messages": ASK, **extra}
    status, got = frontend.request("POST", "/v1/messages", body, {"x-api-key": KEY})
    assert status == (404 if kind == "not_found_error" else 400), got
    assert got["type"] == "error" and got["error"]["type"] == kind
    assert words in got["error"]["message"]


def test_max_tokens_is_required_and_keys_are_checked(claude, frontend, model):
    status, got = frontend.request(
        "POST", "/v1/messages", {"model": model, "messages": ASK}, {"x-api-key": KEY}
    )
    assert status == 400 and "max_tokens" in got["error"]["message"]
    bad = anthropic.Anthropic(base_url=frontend.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=model, max_tokens=8, messages=ASK)
    assert _error(e.value)["type"] == "authentication_error"
    status, _ = frontend.request(
        "POST", "/v1/messages", {"model": model, "max_tokens": 1, "messages": ASK},
        {"authorization": f"Bearer {KEY}"},
    )  # fmt: skip
    assert status == 200  # bearer works here too


@pytest.mark.parametrize("stream", [False, True])
def test_a_scheduler_refusal_is_an_error_in_anthropics_shape(claude, model, stream):
    """A tool schema the grammar engine cannot compile is refused by the scheduler before any
    output: an HTTP 400 in Anthropic's shape, streamed or not."""
    bad = {"name": "f", "input_schema": {"type": "no-such-type"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=model, max_tokens=8, messages=ASK, tools=[bad],
            tool_choice={"type": "tool", "name": "f"}, stream=stream,
        )  # fmt: skip
    error = _error(e.value)
    assert error["type"] == "invalid_request_error" and "structured_output" in error["message"]
