"""A batch input file's lines: parsed and checked one by one, each error naming its line as
OpenAI's batch `errors.data` do (`code`, `message`, `param`, `line`, 1-based)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from frontend_svc import features

__all__ = ["ABORTABLE", "ENDPOINTS", "BatchLine", "LineError", "parse_lines", "parse_window"]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", *features.BATCH_ENDPOINTS)
# The endpoints whose lines run as scheduler requests that an abort stops (a feature's endpoint
# may be one unary call, with no request to abort).
ABORTABLE = frozenset({"/v1/chat/completions", "/v1/completions"})
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_CUSTOM_ID_LEN = 512


@dataclass(frozen=True, slots=True)
class BatchLine:
    index: int  # 0-based position in the file: the order of the output file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LineError:
    code: str
    message: str
    line: int | None = None  # 1-based, as OpenAI reports it
    param: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def parse_window(text: str) -> int:
    """A completion_window in seconds: OpenAI's "24h", or any `<n>s|m|h|d` from 1 s to 7 days
    (short windows make expiry testable). ValueError otherwise."""
    m = _WINDOW.match(text or "")
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not 1 <= seconds <= 7 * 86400:
        raise ValueError(f'completion_window must be like "24h" (1s to 7d), got {text!r}')
    return seconds


def _check(obj: Any, n: int, seen: set[str]) -> LineError | BatchLine:
    if not isinstance(obj, dict):
        return LineError("invalid_json_line", "each line must be a JSON object", n)
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        return LineError("invalid_request", f"unknown fields: {', '.join(sorted(extra))}", n)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID_LEN:
        msg = f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID_LEN} characters"
        return LineError("invalid_custom_id", msg, n, "custom_id")
    if cid in seen:
        return LineError("duplicate_custom_id", f"custom_id {cid!r} is used twice", n, "custom_id")
    seen.add(cid)
    if obj.get("method") != "POST":
        return LineError("invalid_method", 'method must be "POST"', n, "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        return LineError("invalid_url", f"url must be one of {', '.join(ENDPOINTS)}", n, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError("invalid_body", "body must be a JSON object", n, "body")
    if body.get("stream"):
        # A batch line's answer is one JSON body; a stream has no place in the output file.
        return LineError("invalid_body", "stream is not available in a batch", n, "body.stream")
    return BatchLine(n - 1, cid, url, body)


def parse_lines(data: bytes, max_errors: int = 100) -> tuple[list[BatchLine], list[LineError]]:
    """Every line of a JSONL file checked (blank lines skipped, as JSONL readers do; numbering
    counts them). Unlike OpenAI, a line's url need not be the batch's endpoint: one batch may
    mix lines of any of ENDPOINTS. At most `max_errors` errors are kept."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [LineError("invalid_file", f"the file is not UTF-8 ({e.reason})")]
    lines: list[BatchLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            found: LineError | BatchLine = LineError("invalid_json_line", f"not JSON: {e}", n)
        else:
            found = _check(obj, n, seen)
        if isinstance(found, LineError):
            if len(errors) < max_errors:
                errors.append(found)
        else:
            lines.append(found)
    if not lines and not errors:
        errors.append(LineError("empty_file", "the file has no lines"))
    return lines, errors
