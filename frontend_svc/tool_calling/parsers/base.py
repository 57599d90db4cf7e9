"""What a tool-call parser is: a function of the model's text so far to a `Scan`.

A parser reads the whole text each time (outputs are short) and answers with what is already
certain: the content a client may be sent, and each call's name (once whole) and the prefix
of its arguments' JSON text seen so far. Every answer must be a prefix of the next one and of
the final answer (`final=True`, the whole output): that is what lets one driver (stream.py)
turn successive scans into stream deltas whose concatenation is exactly what parsing the whole
text gives. A final scan of text that does not parse as calls gives it all as content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class PartialCall:
    name: str | None = None  # known once the name's string is complete
    arguments: str = ""  # JSON text of the arguments, a prefix until `complete`
    complete: bool = False


@dataclass(slots=True)
class Scan:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(ABC):
    """One model family's tool-call format. Instances hold no state between scans."""

    name: ClassVar[str] = ""
    # Special tokens a format needs to see in the text (e.g. Hermes' <tool_call>, which some
    # tokenizers mark special): False makes the request keep them (skip_special_tokens=False).
    skip_special_tokens: ClassVar[bool | None] = None
    # Where a call starts and ends (what `call_structures` begins and ends with), for formats
    # that have markers: "" otherwise.
    trigger: ClassVar[str] = ""
    end_marker: ClassVar[str] = ""

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """What `text` (the output so far, or all of it when `final`) certainly holds."""

    def call_structures(self, name: str, schema: dict[str, Any]) -> dict[str, Any] | None:
        """How a call of `name` is written, as a structural tag's structure (`begin`, `schema`,
        `end`) whose `begin` starts with `trigger`: what lets tool_choice "auto" hold strict
        tools' arguments to their schemas. None: this format cannot be (strict tools under
        "auto" are then refused)."""
        return None


def hold_back(text: str, marker: str) -> str:
    """`text` less what may still turn out to be the start of `marker`, and less trailing
    whitespace (which content before a call does not keep)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            text = text[:-k]
            break
    return text.rstrip()
