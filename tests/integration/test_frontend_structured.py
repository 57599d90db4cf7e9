"""Structured outputs through the official openai client on /v1/chat/completions and
/v1/completions: every spelling reaches the scheduler as one constraint, and mistakes are
400s in OpenAI's shape naming the field; enforced outputs hold to their constraint.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel
from tokenizers import Tokenizer

from tests.support.stack import llmserve_stack  # noqa: F401 - the fixture

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["answer", "size"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Is it large?"}]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs.backend"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_bad_constraints_are_400s_naming_the_field(oai, model, route, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=extra)
        else:
            oai.completions.create(model=model, prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


# ------------------------------------------------------------------ need grammar enforcement


@pytest.fixture(scope="module")
def enforced(oai, model, llmserve_stack) -> dict[str, float]:  # noqa: F811
    """Checks that the scheduler enforces structured outputs; then a logit_bias that bans
    every token holding whitespace (a random model whose constrained choices tie would pad
    JSON with whitespace up to max_tokens)."""
    got = oai.completions.create(
        model=model, prompt="Yes or no?", max_tokens=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    # Enforcement is on main: an unconstrained answer here is a failure, never a skip.
    assert got.choices[0].text in ("yes", "no"), got.choices[0].text
    vocab = Tokenizer.from_file(str(llmserve_stack.model_dir / "tokenizer.json"))
    spaced = [i for i in range(vocab.get_vocab_size()) if re.search(r"\s", vocab.decode([i]))]
    return {str(i): -100.0 for i in spaced}


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"structured_outputs": {"regex": "[0-9]{3}-[ab]"}},
         lambda t: re.fullmatch("[0-9]{3}-[ab]", t)),
        ({"guided_json": SCHEMA}, lambda t: set(json.loads(t)) == {"answer", "size"}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
         lambda t: json.loads(t)["size"] in ("small", "large")),
    ],
)  # fmt: skip
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_outputs_hold_to_their_constraint(oai, model, enforced, route, extra, check):
    kwargs = dict(model=model, max_tokens=48, temperature=0, logit_bias=enforced, extra_body=extra)
    if route == "chat":
        text = oai.chat.completions.create(messages=ASK, **kwargs).choices[0].message.content
    else:
        text = oai.completions.create(prompt="Colour:", **kwargs).choices[0].text
    assert check(text), text


class Answer(BaseModel):
    # No free text: a random model's tied choices could fill a string up to max_tokens.
    answer: bool
    size: Literal["small", "large"]


def test_parse_with_a_pydantic_model(oai, model, enforced):
    got = oai.chat.completions.parse(
        model=model, messages=ASK, response_format=Answer, max_tokens=48, temperature=0,
        logit_bias=enforced,
    )  # fmt: skip
    message = got.choices[0].message
    assert isinstance(message.parsed, Answer)
    assert Answer.model_validate_json(message.content) == message.parsed


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"grammar": "start: ((("}}, "structured_outputs.grammar"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_constraints_the_scheduler_rejects_name_the_field(
    oai, model, enforced, extra, param, stream
):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(
            model=model, prompt="x", max_tokens=4, extra_body=extra, stream=stream
        )
    assert e.value.body["param"] == param
    assert "structured_output" in e.value.body["message"]
