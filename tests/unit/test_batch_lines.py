"""A batch input file's lines as the Batch API checks them (frontend_svc/batch/lines.py)."""

from __future__ import annotations

import json

import pytest

from frontend_svc.batch.lines import parse_lines, parse_window


def _row(cid: str = "a", **over) -> str:
    row = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"x": 1}}
    return json.dumps({**row, **over})


def test_good_lines_keep_their_position_and_mix_endpoints():
    data = "\n".join(
        [_row("a"), "", _row("b", url="/v1/completions"), _row("c", url="/v1/embeddings")]
    )
    lines, errors = parse_lines(data.encode())
    assert errors == []
    # A blank line is skipped but still counted: positions are the file's own.
    assert [(ln.index, ln.custom_id, ln.url) for ln in lines] == [
        (0, "a", "/v1/chat/completions"),
        (2, "b", "/v1/completions"),
        (3, "c", "/v1/embeddings"),
    ]


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        ("[1, 2]", "invalid_json_line", None),
        ("{oops", "invalid_json_line", None),
        (_row("a", extra=1), "invalid_request", None),
        (_row(""), "invalid_custom_id", "custom_id"),
        (_row("a", method="GET"), "invalid_method", "method"),
        (_row("a", url="/v1/responses"), "invalid_url", "url"),
        (_row("a", body=[1]), "invalid_body", "body"),
        (_row("a", body={"stream": True}), "invalid_body", "body.stream"),
    ],
)
def test_each_bad_line_is_named(raw, code, param):
    lines, errors = parse_lines(f"{_row('first')}\n{raw}\n".encode())
    assert [ln.custom_id for ln in lines] == ["first"]
    assert [(e.code, e.line, e.param) for e in errors] == [(code, 2, param)]


def test_duplicates_empty_files_and_bytes_that_are_not_text():
    _, errors = parse_lines(f"{_row('a')}\n{_row('a')}\n".encode())
    assert [(e.code, e.line) for e in errors] == [("duplicate_custom_id", 2)]
    assert [e.code for e in parse_lines(b"\n\n")[1]] == ["empty_file"]
    assert [e.code for e in parse_lines(b"\xff\xfe")[1]] == ["invalid_file"]
    many = "\n".join("nope" for _ in range(300)).encode()
    assert len(parse_lines(many, max_errors=7)[1]) == 7


def test_completion_windows():
    assert parse_window("24h") == 86400
    assert parse_window("90s") == 90 and parse_window("2d") == 172800
    for bad in ("", "24", "0s", "8d", "1w", "-1h"):
        with pytest.raises(ValueError, match="completion_window"):
            parse_window(bad)
