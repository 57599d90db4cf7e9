"""Reasoning output (`--reasoning-parser`): a model's thinking, written between `<think>` and
`</think>`, split from its answer, whole (`split`) or as it streams (`ReasoningStream`).

Two styles, by vLLM's names: `qwen3` (the reasoning is there only when the output starts with
`<think>`) and `deepseek_r1` (the template opens `<think>` in the prompt, so the output may
start inside it: everything up to the first `</think>` is reasoning, and an output that never
closes it is reasoning throughout). As the tool parsers (tool_calling/parsers/base.py), a scan of
the text so far answers only what is certain, each scan a prefix of the next and of the final
one, so a stream's deltas add up to the whole answer wherever the tags were split.

A constraint on the output (a tool call's schema, a response format) applies to the answer
after the reasoning: the constraint's feature wraps it so that the reasoning goes through first
(docs/internals.md, "Features").
"""

from __future__ import annotations

from dataclasses import dataclass

from frontend_svc.tool_calling.parsers.base import hold_back

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
