"""The reasoning parsers (frontend_svc/reasoning.py): what a whole output splits into, and that
a stream's deltas add up to exactly that wherever the text was cut, tags included."""

from __future__ import annotations

import pytest

from client.structured import StructuredOutput
from frontend_svc.errors import APIError
from frontend_svc.reasoning import PARSERS, ReasoningStream
from frontend_svc.structured.reasoning import TagRefs, after_reasoning

OUTPUTS = [
    "<think>\nThe user greets; say hi.\n</think>\n\nHello there!",
    "<think>cut off while thinking",
    "no reasoning at all",
    "  <think>a</think>b</think>c",  # only the first end tag ends the reasoning
    "<thin",  # a start tag that never completes
    "<think></think>",
    "<think>x</thi",
    "thinking without the start tag</think>answer",  # the template opened <think>
]

WANT = {
    "qwen3": [
        ("The user greets; say hi.", "Hello there!"),
        ("cut off while thinking", ""),
        (None, "no reasoning at all"),
        ("a", "b</think>c"),
        (None, "<thin"),
        (None, ""),
        ("x</thi", ""),
        (None, "thinking without the start tag</think>answer"),
    ],
    "deepseek_r1": [
        ("The user greets; say hi.", "Hello there!"),
        ("cut off while thinking", ""),
        ("no reasoning at all", ""),
        ("a", "b</think>c"),
        ("<thin", ""),
        (None, ""),
        ("x</thi", ""),
        ("thinking without the start tag", "answer"),
    ],
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_whole_outputs_split_as_specified(name):
    parser = PARSERS[name]
    assert [parser.split(text) for text in OUTPUTS] == WANT[name]


def _streamed(name: str, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(PARSERS[name])
    reasoning = content = ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text", OUTPUTS)
def test_every_split_point_streams_the_whole_answer(name, text):
    reasoning, content = PARSERS[name].split(text)
    want = (reasoning or "", content)
    for cut in range(len(text) + 1):
        assert _streamed(name, [text[:cut], text[cut:]]) == want, cut
    for a in range(len(text) + 1):  # and three pieces, every pair of cut points
        for b in range(a, len(text) + 1):
            assert _streamed(name, [text[:a], text[a:b], text[b:]]) == want, (a, b)
    assert _streamed(name, list(text)) == want  # one character at a time


def test_a_stream_sends_no_reasoning_before_the_start_tag_is_certain():
    stream = ReasoningStream(PARSERS["qwen3"])
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>Hm") == ("Hm", "")
    assert stream.feed("m.</th") == ("m.", "")
    assert stream.feed("ink>Hi") == ("", "Hi")


SPECIAL = TagRefs("<think>", "</think>")
TEXT = TagRefs('"<think>"', '"</think>"')


@pytest.mark.parametrize("tags", [SPECIAL, TEXT])
def test_a_constraint_is_moved_after_the_reasoning(tags):
    schema = StructuredOutput("json_schema", '{"type": "object"}')
    got = after_reasoning(schema, PARSERS["qwen3"], tags)
    assert got is not None and got.kind == "grammar"
    assert got.value.rstrip().endswith('"type": "object"}') and tags.end in got.value
    assert '"whitespace_flexible": false' in got.value  # compact JSON, as json_schema is
    optional = after_reasoning(schema, PARSERS["deepseek_r1"], tags)
    assert optional is not None and f"{tags.start.replace(chr(34), '')}" in optional.value
    assert after_reasoning(None, PARSERS["qwen3"], tags) is None
    tag = StructuredOutput("structural_tag", "{}")
    assert after_reasoning(tag, PARSERS["qwen3"], tags) is tag  # free text outside triggers


def test_a_constraint_with_no_inline_form_is_refused():
    with pytest.raises(APIError) as e:
        after_reasoning(StructuredOutput("grammar", "start: /a/"), PARSERS["qwen3"], SPECIAL)
    assert e.value.status == 400 and "grammar" in e.value.message
