"""Reasoning output (`--reasoning-parser`) against a real stack whose tokenizer has `<think>`
and `</think>` tokens and whose model writes known texts (tests/support/tool_model.py; its
`think_then_*` scripts also split the tags across tokens, so streams split them)."""

from __future__ import annotations

import json

import anthropic
import pytest
from tokenizers import Tokenizer

from tests.support.frontend import openai_client, running_frontend
from tests.support.tool_model import SCRIPTS, script_bias, tool_stack

ASK = [{"role": "user", "content": "Hi!"}]
TOKYO = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llmserve_stack(tmp_path_factory):
    with tool_stack(tmp_path_factory.mktemp("reasoning")) as stack:
        yield stack


@pytest.fixture(scope="module")
def frontend_args() -> list[str]:
    return ["--reasoning-parser", "qwen3"]


@pytest.fixture(scope="module")
def vocab(llmserve_stack) -> Tokenizer:
    return Tokenizer.from_file(str(llmserve_stack.model_dir / "tokenizer.json"))


def _create(oai, vocab, script: str, stream: bool, **extra):
    return oai.chat.completions.create(
        model=oai.models.list().data[0].id,
        messages=ASK, max_tokens=64, temperature=0, logit_bias=script_bias(vocab, script),
        stream=stream, **extra,
    )  # fmt: skip


def _streamed(chunks) -> tuple[str, str, str | None]:
    reasoning = content = ""
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_the_tokenizer_has_the_tags_as_tokens(vocab):
    assert vocab.token_to_id("<think>") is not None and vocab.token_to_id("</think>") is not None
    assert SCRIPTS["think_then_answer"][0] == "<thi"  # and a script that splits them


@pytest.mark.parametrize("script", ["think_then_answer", "think_then_json", "plain_text"])
def test_whole_and_streamed_splits_are_equal(oai, vocab, script):
    whole = _create(oai, vocab, script, stream=False).choices[0]
    text = "".join(SCRIPTS[script])
    if script == "plain_text":
        assert whole.message.reasoning_content is None and whole.message.content == text
    else:
        reasoning, _, answer = text.partition("</think>")
        assert whole.message.reasoning_content == reasoning.removeprefix("<think>").strip()
        assert whole.message.content == answer.lstrip()
    got = _streamed(_create(oai, vocab, script, stream=True))
    want = (whole.message.reasoning_content or "", whole.message.content, whole.finish_reason)
    assert got == want


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_applies_after_the_reasoning(oai, vocab, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": TOKYO}}
    got = _create(oai, vocab, "think_then_json", stream, response_format=fmt)
    if stream:
        reasoning, content, _ = _streamed(got)
    else:
        reasoning, content = (
            got.choices[0].message.reasoning_content,
            got.choices[0].message.content,
        )
    # The reasoning is the model's own (the grammar let it through); the answer, which the
    # model would write as {"city": "Paris"}, is held to the schema.
    assert reasoning == "Which city? Paris."
    assert json.loads(content) == {"city": "Tokyo"}


def test_deepseek_r1_reads_an_output_without_the_start_tag_as_reasoning(
    llmserve_stack, vocab, tmp_path
):
    parser = ("--reasoning-parser", "deepseek_r1")
    with running_frontend(tmp_path, llmserve_stack.address, *parser) as fe:
        client = openai_client(fe)
        got = _create(client, vocab, "plain_text", stream=False).choices[0].message
        assert got.reasoning_content == "".join(SCRIPTS["plain_text"]) and got.content == ""
        got = _create(client, vocab, "think_then_answer", stream=False).choices[0].message
        assert (got.reasoning_content, got.content) == ("A greeting; say hi.", "Hello there!")
        # The Messages API (which has no logit_bias: unbiased, the model writes its default
        # script, no tags) answers with the reasoning as a thinking block, whole and streamed.
        claude = anthropic.Anthropic(base_url=fe.base_url, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        whole = claude.messages.create(model=model, max_tokens=64, messages=ASK)
        assert [(b.type, b.thinking) for b in whole.content] == [
            ("thinking", "".join(SCRIPTS["single_call"]).strip())
        ]
        with claude.messages.stream(model=model, max_tokens=64, messages=ASK) as s:
            final = s.get_final_message()
        assert [(b.type, b.thinking) for b in final.content] == [
            (b.type, b.thinking) for b in whole.content
        ]
        # And the Responses API with a reasoning item before the (here empty) message.
        got = client.responses.create(model=model, input=ASK, max_output_tokens=64)
        assert [i.type for i in got.output] == ["reasoning", "message"]
        assert got.output[0].content[0].text == whole.content[0].thinking
        assert got.output_text == ""
        events = list(client.responses.create(model=model, input=ASK, max_output_tokens=64,
                                              stream=True))  # fmt: skip
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == whole.content[0].thinking
        assert events[-1].response.output[0].content == got.output[0].content
