"""Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` (vLLM's `hermes`). Text before the first call is content; text between and after
calls is dropped. The last call may lack its closing tag (the model stopped right after it)."""

from __future__ import annotations

import json
from typing import Any

from frontend_svc.tool_calling.parsers import register_tool_parser
from frontend_svc.tool_calling.parsers.base import Scan, ToolParser, hold_back
from frontend_svc.tool_calling.parsers.json_scan import Malformed, scan_call, skip_ws, valid_call

START, END = "<tool_call>", "</tool_call>"
_ARG_KEYS = ("arguments", "parameters")


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    skip_special_tokens = False  # Qwen's tokenizers mark <tool_call> special
    trigger, end_marker = START, END

    def call_structures(self, name: str, schema: dict[str, Any]) -> dict[str, Any] | None:
        # The spacing the Hermes templates write (and the scheduler's compact JSON keeps).
        begin = f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        return {"begin": begin, "schema": schema, "end": f"}}\n{END}"}

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(text if final else hold_back(text, START))
        out = Scan(text[:first].rstrip())
        spans = []
        pos = first
        try:
            while pos >= 0:
                body = skip_ws(text, pos + len(START))
                if body >= len(text):
                    break
                obj = scan_call(text, body, _ARG_KEYS)
                out.calls.append(obj.call)
                if obj.end is None:
                    break
                spans.append((body, obj.end))
                pos = text.find(START, obj.end)
        except Malformed:
            return Scan(text) if final else out
        if final and not _whole(text, out, spans):
            return Scan(text)
        return out


def _whole(text: str, out: Scan, spans: list[tuple[int, int]]) -> bool:
    return (
        len(spans) == len(out.calls)
        and all(c.complete and c.name is not None for c in out.calls)
        and all(valid_call(text[a:b], _ARG_KEYS) for a, b in spans)
    )
