"""Structured outputs on a real model (SmolLM2-135M-Instruct, 49k-token BPE vocabulary): chat
prompts that ask for what the constraint enforces; every output parses and validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from client import ChatPrompt, LLMClient, SamplingParams
from client import structured as so

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(smollm2_stack):
    with LLMClient(smollm2_stack.address, timeout=300) as c:
        c.wait_ready(120)
        yield c


def chat(text: str) -> ChatPrompt:
    return ChatPrompt([{"role": "user", "content": text}])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_real_model_outputs_validate(client: LLMClient, temperature: float) -> None:
    cases = [
        (chat("Describe a person as JSON with name, age and city."), so.json_schema(PERSON)),
        (chat("Give me a JSON object describing a cat."), so.json_object()),
        (chat("Is the sky blue? Answer yes or no."), so.choice(["yes", "no"])),
        (chat("Write a US phone number."), so.regex(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")),
        (chat("Add two small numbers."), so.grammar('start: NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,3}/')),
    ]  # fmt: skip
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=256, structured_output=spec)
        for i, (_, spec) in enumerate(cases)
    ]
    outs = client.generate([p for p, _ in cases], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    # Any JSON object has no bound: a small model may loop inside a string until max_tokens
    # cuts it (the output is then incomplete, as in vLLM); one that stops parses.
    if outs[1].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[1]), dict), texts[1]
    else:
        assert outs[1].outputs[0].finish_reason == "length" and texts[1].startswith("{")
    assert texts[2] in ("yes", "no")
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", texts[3]), texts[3]
    assert re.fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3} = [0-9]{1,3}", texts[4]), texts[4]
    assert all(o.outputs[0].finish_reason == "stop" for i, o in enumerate(outs) if i != 1), texts
