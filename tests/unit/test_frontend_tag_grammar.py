"""Strict tools' structural tag as a Lark grammar naming special-token markers
(frontend_svc/structured/tool_tags.py), checked with llguidance itself on a tokenizer that has
Qwen's `<tool_call>` and `</tool_call>` as tokens (which llguidance sees as special)."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from frontend_svc.structured.tool_tags import tag_grammar
from frontend_svc.tool_calling.models import FunctionDefinition
from frontend_svc.tool_calling.parsers import parser_class
from frontend_svc.tool_calling.protocol import strict_call_tag
from tests.support.tool_model import build_tokenizer

WEATHER = FunctionDefinition(
    name="get_weather",
    strict=True,
    parameters={
        "type": "object",
        "properties": {"city": {"enum": ["Tokyo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
CALL = '\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def _matcher(tokenizer, grammar: str) -> llguidance.LLMatcher:
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _accepts(m: llguidance.LLMatcher, ids: list[int]) -> bool:
    m = m.deep_copy()
    return m.consume_tokens(ids) and m.is_accepting()


def _ids(tokenizer, *parts: str) -> list[int]:
    out = []
    for p in parts:
        out += tokenizer.encode(p, add_special_tokens=False)
    return out


def test_special_markers_are_matched_as_the_tokens_the_model_writes(tokenizer):
    tag = strict_call_tag([WEATHER], parser_class("hermes")())
    grammar = tag_grammar(tag, {"<tool_call>", "</tool_call>"})
    assert "TEXT <tool_call> " in grammar and grammar.rstrip().endswith("</tool_call>")
    m = _matcher(tokenizer, grammar)
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
    assert _accepts(m, _ids(tokenizer, "Sure. ") + [start] + _ids(tokenizer, CALL) + [end])
    assert _accepts(m, _ids(tokenizer, "No call needed."))
    bad = CALL.replace("Tokyo", "Paris")
    assert not _accepts(m, [start] + _ids(tokenizer, bad) + [end])  # strict: held to the schema


def test_text_markers_keep_the_lazy_text_trigger(tokenizer):
    tag = strict_call_tag([WEATHER], parser_class("hermes")())
    grammar = tag_grammar(tag, set())
    assert '[lazy]: TEXT "<tool_call>"' in grammar
    _matcher(tokenizer, grammar)  # compiles
