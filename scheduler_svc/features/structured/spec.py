"""A request's structured-output constraint as plain data, and its grammar text.

The constraint lives in `SamplingParams.structured_output` as a one-key dict mirroring the
public proto's oneof (`{"json_schema": "<json>"}`, `{"json_object": True}`, `{"regex": ...}`,
`{"choice": [...]}`, `{"grammar": ...}`, `{"structural_tag": "<json>"}`). Being part of the
parameters, it is stored in Redis with them, so a recovered request rebuilds its matcher.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from scheduler_svc.core.sampling_params import ValidationError

__all__ = ["KINDS", "MAX_CHOICES", "MAX_SPEC_BYTES", "check_spec", "grammar_text", "spec_key"]

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_BYTES = 64 * 1024  # schema / regex / grammar text, or all choices together
MAX_CHOICES = 1024

_FIELD = "params.structured_output"
# Compact JSON (", " and ": " separators, no free whitespace): a model cannot pad the output
# with whitespace forever. A schema's own "x-guidance" options still override this.
_JSON_OPTIONS = {"whitespace_flexible": False}


def check_spec(spec: dict[str, Any]) -> None:
    """Shape and size limits (the grammar itself is checked by compiling it)."""
    if len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValidationError(f"{_FIELD} must set exactly one of {', '.join(KINDS)}")
    kind, value = next(iter(spec.items()))
    if kind == "json_object":
        if value is not True:
            raise ValidationError(f"{_FIELD}.json_object must be true when set")
        return
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise ValidationError(f"{_FIELD}.choice must list at least one string")
        if len(value) > MAX_CHOICES:
            raise ValidationError(
                f"{_FIELD}.choice may hold at most {MAX_CHOICES} strings, got {len(value)}"
            )
        if not all(isinstance(c, str) and c for c in value):
            raise ValidationError(f"{_FIELD}.choice entries must be non-empty strings")
        size = sum(len(c.encode()) for c in value)
    else:
        if not isinstance(value, str) or not value:
            raise ValidationError(f"{_FIELD}.{kind} must be non-empty text")
        size = len(value.encode())
    if size > MAX_SPEC_BYTES:
        raise ValidationError(
            f"{_FIELD}.{kind} is {size} bytes; at most {MAX_SPEC_BYTES} are accepted"
        )


def spec_key(spec: dict[str, Any]) -> str:
    """A canonical text of the spec, the grammar cache's key (with the tokenizer)."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def grammar_text(spec: dict[str, Any]) -> str:
    """llguidance's grammar for the spec; ValidationError with the library's message when the
    text cannot even be parsed (compiling catches the rest)."""
    kind, value = next(iter(spec.items()))
    try:
        if kind == "json_schema":
            json.loads(value)  # the library's message for bad JSON is less direct
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=_JSON_OPTIONS
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llguidance.grammar_from("choice", value)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted
        return _structural_tag(value)
    except (ValueError, TypeError, KeyError) as e:
        raise ValidationError(f"{_FIELD}.{kind}: {e}") from None


def _structural_tag(text: str) -> str:
    """vLLM's shape: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    obj = json.loads(text)
    triggers = obj.get("triggers") or []
    tags = []
    for s in obj.get("structures") or []:
        begin = s["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), begin)
        schema = s.get("schema") or {"type": "object"}
        tags.append(
            llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=s["end"])
        )
    if not tags:
        raise ValueError("structural_tag needs at least one entry in 'structures'")
    # Triggers are text: a "<...>" trigger is not assumed to be one special token.
    return llguidance.StructTag.to_grammar(tags, assume_special=False)
