"""Llama 3.x JSON tool calls (vLLM's `llama3_json`): the output starts with a call object
`{"name": ..., "parameters": {...}}` (after an optional `<|python_tag|>`), further calls
separated by `;`. Output that does not start with `{` is content, all of it."""

from __future__ import annotations

from frontend_svc.tool_calling.parsers import register_tool_parser
from frontend_svc.tool_calling.parsers.base import Scan, ToolParser
from frontend_svc.tool_calling.parsers.json_scan import Malformed, scan_call, skip_ws, valid_call

PYTHON_TAG = "<|python_tag|>"
_ARG_KEYS = ("parameters", "arguments")


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        rest = text[i:]
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(rest):
            return Scan()  # undecided: "" or a prefix of the tag
        if i >= len(text):
            return Scan(text) if final else Scan()
        if text[i] != "{":
            return Scan(text)
        out = Scan()
        spans = []
        try:
            while i < len(text):
                obj = scan_call(text, i, _ARG_KEYS)
                out.calls.append(obj.call)
                if obj.end is None:
                    break
                spans.append((i, obj.end))
                i = skip_ws(text, obj.end)
                if i < len(text) and text[i] == ";":
                    i = skip_ws(text, i + 1)
                elif i < len(text):
                    raise Malformed(f"expected ';' at {i}")
        except Malformed:
            return Scan(text) if final else out
        if final and not (
            len(spans) == len(out.calls) and all(valid_call(text[a:b], _ARG_KEYS) for a, b in spans)
        ):
            return Scan(text)
        return out
