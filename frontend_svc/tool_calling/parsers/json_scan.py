"""Reading JSON that is still arriving: where a value ends (if it has), and what a call object
(`{"name": ..., "arguments": {...}}`) holds so far, with the arguments as their raw text."""

from __future__ import annotations

import json
from dataclasses import dataclass

from frontend_svc.tool_calling.parsers.base import PartialCall

_WS = " \t\n\r"
_SCALAR_END = ",}]" + _WS


class Malformed(ValueError):
    """The text cannot become the JSON expected there."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value starting at `text[start]`, None while incomplete."""
    c = text[start]
    if c == '"':
        return _string_end(text, start)
    if c in "{[":
        depth, i = 0, start
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = start
    while i < len(text) and text[i] not in _SCALAR_END:
        i += 1
    return i if i < len(text) else None  # a number may go on


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


@dataclass(slots=True)
class ObjectScan:
    call: PartialCall
    end: int | None  # after the closing brace, once the object is whole


def scan_call(text: str, start: int, arg_keys: tuple[str, ...]) -> ObjectScan:
    """The call object starting at `text[start]` ('{'): its name once whole, its arguments
    (the value of the first of `arg_keys` present) as raw text, streamed only while they are
    an object, list or string (a scalar waits until whole). Raises Malformed."""
    if text[start] != "{":
        raise Malformed(f"expected '{{' at {start}")
    call = PartialCall()
    seen_args = False
    i = skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            call.complete = True
            if not seen_args:
                call.arguments = "{}"
            return ObjectScan(call, i + 1)
        key_end = _string_end(text, i) if text[i] == '"' else None
        if text[i] != '"':
            raise Malformed(f"expected a key at {i}")
        if key_end is None:
            break
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            raise Malformed(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            break
        end = value_end(text, i)
        if key == "name":
            if end is None:
                break
            name = json.loads(text[i:end])
            if not isinstance(name, str):
                raise Malformed("a call's name must be a string")
            call.name = name
        elif key in arg_keys and not seen_args:
            seen_args = True
            if end is None:
                if text[i] in '{["':
                    call.arguments = text[i:]
                break
            call.arguments = text[i:end]
        if end is None:
            break
        i = skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
        elif i < len(text) and text[i] != "}":
            raise Malformed(f"expected ',' or '}}' at {i}")
    return ObjectScan(call, None)


def valid_call(text: str, arg_keys: tuple[str, ...]) -> bool:
    """Whether `text` is one whole call object: JSON, with a string name and arguments (if
    any) that are a JSON object."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return False
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return isinstance(args, dict)
