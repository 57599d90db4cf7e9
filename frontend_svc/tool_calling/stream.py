"""A choice's text read as content and tool calls, whole (`extract`) or as it streams
(`ToolCallStream`), by one parser (parsers/base.py).

Streamed, a call goes out as OpenAI sends it: first a delta with its index, id, type and name
(arguments ""), then its arguments in fragments; content deltas carry the text before the
calls. Every delta is the difference between two successive scans, and a scan is a prefix of
the next, so a stream's concatenated deltas equal the whole-text answer for any output that
parses. A malformed call may have been partly streamed before it turned out malformed; the
stream then ends there, where the whole-text answer gives the text as content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from frontend_svc.tool_calling.parsers.base import PartialCall, Scan, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class Extracted:
    content: str | None  # None when empty
    tool_calls: list[dict[str, Any]]  # OpenAI tool-call objects


def extract(parser: ToolParser, text: str, max_calls: int | None = None) -> Extracted:
    scan = parser.scan(text, final=True)
    calls = [_call(c, call_id()) for c in scan.calls[:max_calls] if c.name is not None]
    return Extracted(scan.content or None, calls)


def _call(c: PartialCall, cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


class ToolCallStream:
    """One streamed choice: `feed` each text delta, `finish` at the end; each returns the
    content to send and the tool-call deltas (OpenAI's `delta.tool_calls` entries)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = ""
        self.sent_args: list[str] = []  # per call whose name went out
        self.ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.sent_args)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        return self._advance(self.parser.scan(self.text, final=False))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        scan = self.parser.scan(self.text, final=True)
        if self.sent_args and not scan.calls:
            # A call went out before the text turned out malformed (cut by max_tokens): the
            # stream keeps to what it sent rather than repeat the call's text as content.
            return "", []
        return self._advance(scan)

    def _advance(self, scan: Scan) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        if scan.content.startswith(self.sent_content):
            content = scan.content[len(self.sent_content) :]
            self.sent_content = scan.content
        out: list[dict[str, Any]] = []
        for k, call in enumerate(scan.calls[: self.max_calls]):
            if call.name is None:
                break  # later calls wait for this one's name: indexes go out in order
            if k == len(self.sent_args):
                self.ids.append(call_id())
                self.sent_args.append("")
                function = {"name": call.name, "arguments": ""}
                out.append(
                    {"index": k, "id": self.ids[k], "type": "function", "function": function}
                )
            sent = self.sent_args[k]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append({"index": k, "function": {"arguments": call.arguments[len(sent) :]}})
                self.sent_args[k] = call.arguments
        return content, out
