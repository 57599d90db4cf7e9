"""A structural tag (strict tools under tool_choice "auto") as an llguidance Lark grammar that
names a call's markers as special tokens where the tokenizer has them as such.

The scheduler compiles a `structural_tag` with its markers as text. llguidance, though, treats
a tokenizer's `<...>`-shaped added tokens (Qwen's `<tool_call>`, `</tool_call>`) as special:
never as the text they spell. A text marker then cannot match the token the model writes, and
the model is held to spelling it out in other tokens. So where a marker is one such token, the
frontend sends the grammar itself, with the marker as a token reference (`<tool_call>`); free
text cannot hold a special token, so the text before a call simply runs up to it.
"""

from __future__ import annotations

import json
from typing import Any

from frontend_svc.tool_calling.schema import compact_json


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


def tag_grammar(tag: dict[str, Any], special: set[str]) -> str:
    """The Lark grammar of a structural tag (`structures` of `begin`, `schema`, `end`, and
    `triggers`); markers in `special` are named as tokens."""
    rules = []
    names = []
    for i, s in enumerate(tag["structures"]):
        trigger = next(t for t in tag["triggers"] if s["begin"].startswith(t))
        end_marker = next((m for m in special if s["end"].endswith(m)), "")
        end = s["end"][: len(s["end"]) - len(end_marker)]
        schema = json.dumps(compact_json(s["schema"]), ensure_ascii=False)
        body = " ".join(
            x
            for x in (_lit(s["begin"][len(trigger) :]), f"%json {schema}", _lit(end), end_marker)
            if x
        )
        name = f"call_{i}"
        names.append(name)
        if trigger in special:
            rules.append(f"{name}: TEXT {trigger} {body}")
        else:
            # A text trigger: the text before the call ends at its first occurrence.
            rules.append(f"{name}_start[lazy]: TEXT {_lit(trigger)}")
            rules.append(f"{name}: {name}_start {body}")
    head = ["%llguidance {}", f"start: ({' | '.join(names)})* TEXT", "TEXT: /(.|\\n)*/"]
    return "\n".join(head + rules) + "\n"
