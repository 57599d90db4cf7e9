"""Reasoning output (`--reasoning-parser`): a model's thinking, written between `<think>` and
`</think>`, split from its answer, whole (`split`) or as it streams (`ReasoningStream`).

Two styles, by vLLM's names: `qwen3` (the reasoning is there only when the output starts with
`<think>`) and `deepseek_r1` (the template opens `<think>` in the prompt, so the output may
start inside it: everything up to the first `</think>` is reasoning, and an output that never
closes it is reasoning throughout). As the tool parsers (tool_calling/parsers/base.py), a scan of
the text so far answers only what is certain, each scan a prefix of the next and of the final
one, so a stream's deltas add up to the whole answer wherever the tags were split.

Structured outputs and tool calls apply to the answer after the reasoning: `after_reasoning`
wraps a constraint in a grammar that lets the reasoning through first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from client.async_client import AsyncLLMClient
from client.structured import StructuredOutput
from frontend_svc.errors import bad_request
from frontend_svc.tool_calling.parsers.base import hold_back
from frontend_svc.tool_calling.schema import compact_json
from frontend_svc.tool_calling.tag_grammar import special_markers

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start_optional: bool  # deepseek_r1: the output may begin inside the reasoning

    def scan(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) that `text` certainly holds."""
        head = text.lstrip()
        if head.startswith(START):
            return _after_start(head[len(START) :], final)
        if not final and START.startswith(head):
            return "", ""  # may still become the start tag
        if not self.start_optional:
            return "", text
        return _after_start(text, final)

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole output's reasoning (None when there is none) and content."""
        reasoning, content = self.scan(text, final=True)
        return reasoning or None, content


def _after_start(body: str, final: bool) -> tuple[str, str]:
    end = body.find(END)
    if end < 0:
        # Still thinking (or cut off while thinking): all reasoning, less a partial end tag.
        return (body.strip() if final else hold_back(body, END).lstrip()), ""
    # The blank lines a model writes after `</think>` are no part of its answer.
    return body[:end].strip(), body[end + len(END) :].lstrip()


PARSERS = {
    "qwen3": ReasoningParser("qwen3", start_optional=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", start_optional=True),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; expected one of {', '.join(sorted(PARSERS))}"
        ) from None


class ReasoningStream:
    """One streamed choice: `feed` each text delta, `finish` at the end; each returns the
    (reasoning, content) text to send now."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ("", "")

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._advance(self.parser.scan(self.text, final=False))

    def finish(self) -> tuple[str, str]:
        return self._advance(self.parser.scan(self.text, final=True))

    def _advance(self, scan: tuple[str, str]) -> tuple[str, str]:
        out = tuple(new[len(old) :] for new, old in zip(scan, self.sent, strict=True))
        self.sent = scan
        return out  # type: ignore[return-value]


def after_reasoning(
    constraint: StructuredOutput | None, parser: ReasoningParser, tags: TagRefs
) -> StructuredOutput | None:
    """A constraint that holds the answer after `</think>`, not the reasoning before it: a
    Lark grammar (llguidance's) of free text up to the first `</think>`, then the constraint.
    Kinds with no inline form in that grammar are refused rather than applied to the
    reasoning."""
    if constraint is None or constraint.kind == "structural_tag":
        # A structural tag leaves text outside its triggers free already.
        return constraint
    value = constraint.value
    if constraint.kind in ("json_schema", "json_object"):
        schema = json.loads(value) if constraint.kind == "json_schema" else {"type": "object"}
        if isinstance(schema, dict):
            schema = compact_json(schema)
        answer = f"%json {json.dumps(schema, ensure_ascii=False)}"
    elif constraint.kind == "choice":
        answer = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    elif constraint.kind == "regex" and "/" not in value:
        answer = f"/{value}/"
    else:
        raise bad_request(
            f"a {constraint.kind} constraint cannot be combined with the {parser.name} "
            "reasoning parser (json_schema, json_object, choice and regex can)",
            "response_format",
        )
    start = f"{tags.start}?" if parser.start_optional else tags.start
    if tags.end.startswith('"'):
        # Text tags: the reasoning ends at the first "</think>" (a lazy lexeme; it cannot
        # hold a special token, so the start tag is text here too).
        start = start.replace(tags.start, json.dumps(START))
        reasoning = f"reasoning[lazy]: /[ \\t\\n]*/ {start} /(.|\\n)*/ {tags.end}"
    else:
        # A special end token: free text cannot hold it, so the text simply runs up to it.
        reasoning = f"reasoning: WS {start} TEXT {tags.end}\nTEXT: /(.|\\n)*/"
    grammar = (
        "%llguidance {}\n"
        "start: reasoning WS answer\n"
        f"{reasoning}\n"
        "WS: /[ \\t\\n]*/\n"
        f"answer: {answer}\n"
    )
    return StructuredOutput("grammar", grammar)


@dataclass(frozen=True, slots=True)
class TagRefs:
    """How the grammar names the tags: as text (`"<think>"`), or, where the tokenizer has the
    tag as one `<...>`-shaped added token, as that special token (`<think>`): llguidance sees
    such tokens as special, never as the text they spell."""

    start: str
    end: str


async def tag_refs(client: AsyncLLMClient) -> TagRefs:
    """The tags' names in a grammar for the served model's tokenizer."""
    special = await special_markers(client, [START, END])
    return TagRefs(*(t if t in special else json.dumps(t) for t in (START, END)))
