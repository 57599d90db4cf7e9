"""What a stored request is (format version 1 of ``state/store.py``'s layout): the records the
store reads and writes, and the decoding of a request's hash."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "Created",
    "FinishRecord",
    "StoreFormatError",
    "StoredRequest",
    "TokenAppend",
    "decode_record",
]

FORMAT_VERSION = 1
# The fields of a request's hash this module reads itself. Any other field is an optional
# feature's, written at creation as JSON under the feature's name (StoredRequest.features;
# absent when it stores nothing, so each keeps format version 1); one that is not JSON is
# ignored, as readers ignore fields they do not know.
BASE_FIELDS = frozenset({
    "v", "prompt", "params", "priority", "arrival_time", "n", "status", "finish_reasons",
    "stop_reasons", "error", "prompt_logprobs", "deadline", "trace_context",
})  # fmt: skip


class StoreFormatError(RuntimeError):
    """A stored record was written by a newer, incompatible scheduler."""


class Created(enum.IntEnum):
    """What `RequestStore.create` did with an id."""

    EXISTS = 0  # stored already (nothing written)
    NEW = 1  # stored as active, listed as unfinished
    ABORTED = 2  # an abort came first: stored already finished as aborted


@dataclass(slots=True)
class StoredRequest:
    req_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    priority: int = 0
    arrival_time: float = 0.0
    n: int = 1
    finished: bool = False
    outputs: list[list[int]] = field(default_factory=list)  # per sequence
    logprobs: list[list[Any]] = field(default_factory=list)  # per sequence, JSON entries
    finish_reasons: list[str | None] = field(default_factory=list)
    stop_reasons: list[str | None] = field(default_factory=list)
    error: str = ""
    prompt_logprobs: list[Any] | None = None  # JSON entries, prompt positions 1.. (if asked)
    # The optional features' JSON values, by feature name (each a field of the hash); a
    # feature's stored_entry hook writes its own, its restore hook reads it back.
    features: dict[str, Any] = field(default_factory=dict)
    # Absolute (epoch seconds) time it ends by, 0.0 = none; stored so that a recovered request
    # keeps the deadline it arrived with (features/deadlines).
    deadline: float = 0.0
    # W3C traceparent of its request span ("" untraced): a recovering scheduler links to it.
    trace_context: str = ""


@dataclass(slots=True)
class TokenAppend:
    """Tokens of one sequence produced in one step, starting at output position `offset`."""

    req_id: str
    index: int
    offset: int
    token_ids: list[int]
    logprobs: list[Any] | None = None  # JSON-able entries, one per token, when requested
    # tokens_key_bulk(req_id, index) when the caller keeps it (saves building it every step).
    key_bulk: bytes = b""


@dataclass(slots=True)
class FinishRecord:
    req_id: str
    n: int
    finish_reasons: list[str | None]
    stop_reasons: list[str | None]
    error: str = ""


def decode_record(req_id: str, fields: dict[bytes, bytes]) -> StoredRequest:
    f = {k.decode(): v.decode() for k, v in fields.items()}
    version = int(f.get("v", "0"))
    if version > FORMAT_VERSION:
        raise StoreFormatError(
            f"request {req_id} was stored in format v{version}; this scheduler reads up to "
            f"v{FORMAT_VERSION}: upgrade llmserve"
        )
    if version < 1:
        raise StoreFormatError(f"request {req_id} has no readable format version")
    return StoredRequest(
        req_id=req_id,
        prompt_token_ids=json.loads(f["prompt"]),
        params=json.loads(f["params"]),
        priority=int(f.get("priority", 0)),
        arrival_time=float(f.get("arrival_time", 0.0)),
        n=int(f.get("n", 1)),
        finished=f.get("status") == "finished",
        finish_reasons=json.loads(f.get("finish_reasons", "[]")),
        stop_reasons=json.loads(f.get("stop_reasons", "[]")),
        error=f.get("error", ""),
        prompt_logprobs=json.loads(f["prompt_logprobs"]) if "prompt_logprobs" in f else None,
        features=_feature_fields(f),
        deadline=float(f.get("deadline", 0.0)),
        trace_context=f.get("trace_context", ""),
    )


def _feature_fields(f: dict[str, str]) -> dict[str, Any]:
    out = {}
    for name, text in f.items():
        if name not in BASE_FIELDS:
            try:
                out[name] = json.loads(text)
            except ValueError:
                continue  # not a feature's: some later version's field
    return out
