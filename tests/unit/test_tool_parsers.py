"""Tool-call parsers: calls found in whole texts (single, parallel, text around them,
malformed), and streaming, at any split of the text, gives exactly the whole-text answer."""

from __future__ import annotations

import json
import random

import pytest

from frontend_svc.tool_calling.parsers import parser_class, parser_names, register_tool_parser
from frontend_svc.tool_calling.parsers.base import Scan, ToolParser
from frontend_svc.tool_calling.parsers.forced import CallListParser, NamedCallParser
from frontend_svc.tool_calling.stream import ToolCallStream, extract

HERMES = parser_class("hermes")()
LLAMA = parser_class("llama3_json")()

WEATHER_ARGS = '{"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}'


def calls(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    found = extract(parser, text)
    return found.content, [
        (c["function"]["name"], c["function"]["arguments"]) for c in found.tool_calls
    ]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and calls as a client rebuilds them from the stream's deltas, checking the
    deltas' shape: a call's first delta has its index, id, type and name, later ones only
    argument fragments."""
    stream = ToolCallStream(parser)
    content, names, args, ids = "", {}, {}, set()
    for k, piece in enumerate(pieces):
        text, deltas = stream.feed(piece)
        if k == len(pieces) - 1:
            more_text, more = stream.finish()
            text, deltas = text + more_text, deltas + more
        content += text
        for d in deltas:
            i = d["index"]
            if i not in names:
                assert i == len(names), "calls go out in index order"
                assert d["type"] == "function" and d["id"].startswith("call_")
                assert d["function"]["arguments"] == ""
                ids.add(d["id"])
                names[i], args[i] = d["function"]["name"], ""
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                args[i] += d["function"]["arguments"]
    assert len(ids) == len(names)
    return content or None, [(names[i], args[i]) for i in sorted(names)]


def splits(text: str, seed: int) -> list[list[str]]:
    """The text whole, one character at a time, and in random pieces."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
    random_pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return [[text], list(text), random_pieces]


HERMES_CASES = [
    (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        'Let me check.\n\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"arguments": {}, "name": "b"}\n</tool_call>trailing words',
        "Let me check.",
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    # The last call without its closing tag (the model stopped right after it).
    ('<tool_call>{"name": "a", "arguments": {"y": "z"}}', None, [("a", '{"y": "z"}')]),
    # No arguments at all: none.
    ('<tool_call>{"name": "a"}</tool_call>', None, [("a", "{}")]),
    ("Just text, with a < sign and <tool", "Just text, with a < sign and <tool", []),
    ("", None, []),
]


@pytest.mark.parametrize(("text", "content", "want"), HERMES_CASES)
def test_hermes(text, content, want):
    assert calls(HERMES, text) == (content, want)
    for pieces in splits(text, len(text)) if text else []:
        assert streamed(HERMES, pieces) == (content, want)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "a", "arguments": {"x": 1}',  # cut off
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>',
    ],
)
def test_hermes_malformed_output_is_content(text):
    assert calls(HERMES, text) == (text, [])


def test_a_stream_cut_inside_a_call_ends_with_what_it_sent():
    text = '<tool_call>{"name": "a", "arguments": {"x": 1'
    content, sent = streamed(HERMES, list(text))
    assert content is None and sent == [("a", '{"x": 1')]


LLAMA_CASES = [
    ('{"name": "f", "parameters": {"x": 12}}', None, [("f", '{"x": 12}')]),
    (
        '<|python_tag|>{"name": "f", "parameters": {"x": "a;b"}}; {"name": "g", "arguments": {}}',
        None,
        [("f", '{"x": "a;b"}'), ("g", "{}")],
    ),
    ('  {"name": "f", "parameters": {"q": [1, {"r": 2}]}}  ', None, [("f", '{"q": [1, {"r": 2}]}')]),
    ('The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ('{"name": "f", "parameters": {"x": 1}} and then text', '{"name": "f", "parameters": {"x": 1}} and then text', []),
    ("{not json at all}", "{not json at all}", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "want"), LLAMA_CASES)
def test_llama3_json(text, content, want):
    assert calls(LLAMA, text) == (content, want)
    for pieces in splits(text, len(text)):
        # Output that starts as a call and then goes wrong has had its call streamed already
        # (test_a_stream_cut_inside_a_call_ends_with_what_it_sent); the rest must agree.
        if content is None or not content.startswith("{"):
            assert streamed(LLAMA, pieces) == (content, want)


def test_required_output_is_a_list_of_calls():
    text = '[{"name": "a", "parameters": {"q": "x"}}, {"name": "b", "parameters": {}}]'
    want = (None, [("a", '{"q": "x"}'), ("b", "{}")])
    assert calls(CallListParser(), text) == want
    for pieces in splits(text, len(text)):
        assert streamed(CallListParser(), pieces) == want
    assert calls(CallListParser(), "[]") == ("[]", [])
    assert calls(CallListParser(), '[{"name": "a", "parameters": {') == (
        '[{"name": "a", "parameters": {',
        [],
    )


def test_a_named_call_is_the_whole_output():
    text = ' {"q": "x y ", "n": [1]}\n'
    want = (None, [("f", '{"q": "x y ", "n": [1]}')])
    assert calls(NamedCallParser("f"), text) == want
    for pieces in splits(text, len(text)):
        assert streamed(NamedCallParser("f"), pieces) == want


def test_arguments_stream_in_fragments_after_the_name():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    stream = ToolCallStream(HERMES)
    deltas = [d for ch in text for d in stream.feed(ch)[1]] + stream.finish()[1]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris"}'
    assert json.loads("".join(fragments)) == {"city": "Paris"}


def test_parsers_are_pluggable():
    @register_tool_parser("test_upper")
    class Upper(ToolParser):
        def scan(self, text: str, final: bool) -> Scan:
            return Scan(text.upper())

    assert "test_upper" in parser_names() and {"hermes", "llama3_json"} <= set(parser_names())
    assert calls(parser_class("test_upper")(), "hi") == ("HI", [])
    with pytest.raises(ValueError, match="unknown tool call parser"):
        parser_class("nope")


def test_a_plugin_file_registers_a_parser(tmp_path):
    from frontend_svc.tool_calling.parsers import load_plugin

    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from frontend_svc.tool_calling.parsers import Scan, ToolParser, register_tool_parser\n\n"
        "@register_tool_parser('test_plugin')\n"
        "class Mine(ToolParser):\n"
        "    def scan(self, text, final):\n"
        "        return Scan(text[::-1])\n"
    )
    load_plugin(plugin)
    assert calls(parser_class("test_plugin")(), "abc") == ("cba", [])


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
        (["--tool-call-parser", "nope"], "unknown --tool-call-parser"),
    ],
)
def test_the_frontend_checks_its_tool_flags(argv, error):
    from frontend_svc.cli import build_parser, tool_config

    with pytest.raises(SystemExit, match=error):
        tool_config(build_parser().parse_args(argv))
    config = tool_config(
        build_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    )
    assert config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
