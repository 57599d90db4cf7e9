"""Structured outputs and forced tool calls on a real model (SmolLM2-135M-Instruct, the
conftest's `smollm2_stack`) through the official openai client: what a Pydantic model or a
named function asks for comes back parsed, with the values a trained model gives.
"""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel


@pytest.fixture(scope="module")
def llmserve_stack(smollm2_stack):  # the frontend fixture's stack: SmolLM2 (conftest)
    return smollm2_stack


@pytest.fixture(scope="module")
def enforced(oai, model) -> None:
    got = oai.completions.create(
        model=model, prompt="Is Paris in France?", max_tokens=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    # Enforcement is on main: an unconstrained answer here is a failure, never a skip.
    assert got.choices[0].text in ("yes", "no"), got.choices[0].text


class City(BaseModel):
    name: str
    country: str


ASK = [{"role": "user", "content": "Give the name and country of the capital of France."}]


def test_parse_with_a_pydantic_model(oai, model, enforced):
    got = oai.chat.completions.parse(
        model=model, messages=ASK, response_format=City, max_tokens=48, temperature=0
    )
    message = got.choices[0].message
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert (message.parsed.name, message.parsed.country.lower()) == ("Paris", "france")


def test_a_named_function_gets_its_arguments(oai, model, enforced):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    got = oai.chat.completions.create(
        model=model, max_tokens=32, temperature=0, tools=tools,
        messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = got.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
