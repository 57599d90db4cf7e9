"""The outputs `tool_choice` forces (schema.py): for "required" a JSON list of
`{"name", "parameters"}`, for a named function its arguments alone. No content either way."""

from __future__ import annotations

from frontend_svc.tool_calling.parsers.base import PartialCall, Scan, ToolParser
from frontend_svc.tool_calling.parsers.json_scan import Malformed, scan_call, skip_ws, valid_call

_ARG_KEYS = ("parameters", "arguments")


class CallListParser(ToolParser):
    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan()
        i = skip_ws(text, 0)
        spans = []
        try:
            if i < len(text) and text[i] != "[":
                raise Malformed("expected '['")
            i = skip_ws(text, i + 1)
            while i < len(text) and text[i] != "]":
                obj = scan_call(text, i, _ARG_KEYS)
                out.calls.append(obj.call)
                if obj.end is None:
                    break
                spans.append((i, obj.end))
                i = skip_ws(text, obj.end)
                if i < len(text) and text[i] == ",":
                    i = skip_ws(text, i + 1)
        except Malformed:
            return Scan(text) if final else out
        if final and not (
            out.calls
            and len(spans) == len(out.calls)
            and all(valid_call(text[a:b], _ARG_KEYS) for a, b in spans)
        ):
            return Scan(text)
        return out


class NamedCallParser(ToolParser):
    """The whole output is the arguments of `function_name` (streamed as they come)."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> Scan:
        args = text.strip() if final else text.lstrip().rstrip()
        return Scan(calls=[PartialCall(self.function_name, args, final)])
