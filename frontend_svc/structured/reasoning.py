"""A constraint held to the answer after the reasoning (`--reasoning-parser`, reasoning.py),
not to the reasoning before it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from client.structured import StructuredOutput
from frontend_svc.errors import bad_request
from frontend_svc.reasoning import END, START, ReasoningParser
from frontend_svc.tool_calling.schema import compact_json


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


async def tag_refs(state: Any) -> TagRefs:
    """The tags' names in a grammar for the served model's tokenizer (``state``: the
    FrontendState, which asks the tokenizer once per tag)."""
    special = await state.special_markers([START, END])
    return TagRefs(*(t if t in special else json.dumps(t) for t in (START, END)))
