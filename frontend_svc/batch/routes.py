"""`/v1/files` and `/v1/batches` in OpenAI's shapes. Each file and batch belongs to the API key
that made it (another key gets 404). With no Redis configured every route answers 503."""

from __future__ import annotations

import email.parser
import email.policy
import functools
import json
import time
import uuid
from typing import Any

import structlog
from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from starlette.requests import Request

from frontend_svc.auth import caller_key
from frontend_svc.batch.lines import ENDPOINTS, parse_lines, parse_window
from frontend_svc.batch.settings import BatchSettings, key_fingerprint
from frontend_svc.batch.store import BatchStore, NotReplicated
from frontend_svc.errors import APIError, bad_request

log = structlog.get_logger(__name__)
router = APIRouter()
_TIMES = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
MAX_ERRORS_SHOWN = 5


def _store_errors(route):
    """Redis away, or too few replicas acknowledging: a 503 the client can retry, not a 500."""

    @functools.wraps(route)
    async def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return await route(*args, **kwargs)
        except (RedisError, NotReplicated) as e:
            log.warning("batch.store_unavailable", error=str(e))
            raise APIError(
                503, "the batch store (Redis) is unavailable; retry", type="service_unavailable"
            ) from None

    return call


def _store(request: Request) -> tuple[BatchStore, BatchSettings, str]:
    store = getattr(request.app.state, "batch_store", None)
    if store is None:
        msg = "the Batch API needs the frontend's --redis-url (or --redis-sentinel)"
        raise APIError(503, msg, type="service_unavailable")
    return store, request.app.state.batch_settings, key_fingerprint(caller_key(request))


def _not_found(what: str, id_: str) -> APIError:
    return APIError(404, f"No {what} with id {id_!r}", type="not_found_error", code="not_found")


async def _body_limited(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            msg = f"the upload is larger than this server's limit of {limit} bytes"
            raise APIError(413, msg, param="file", code="file_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """multipart/form-data fields as name -> (filename, bytes), read with the standard library's
    MIME parser (no extra dependency for one route)."""
    if not content_type.startswith("multipart/form-data"):
        raise bad_request("POST /v1/files takes multipart/form-data (fields file, purpose)")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode()
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    fields = {}
    for part in msg.iter_parts() if msg.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[str(name)] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


@router.post("/v1/files")
@_store_errors
async def create_file(request: Request):
    store, settings, owner = _store(request)
    body = await _body_limited(request, settings.max_file_bytes + 64 * 1024)
    form = _form(request.headers.get("content-type", ""), body)
    purpose = form.get("purpose", (None, b""))[1].decode(errors="replace")
    if purpose != "batch":
        raise bad_request(f'purpose must be "batch", got {purpose!r}', "purpose")
    if "file" not in form:
        raise bad_request("the form has no file field", "file")
    filename, content = form["file"]
    if len(content) > settings.max_file_bytes:
        msg = f"the file is larger than this server's limit of {settings.max_file_bytes} bytes"
        raise APIError(413, msg, param="file", code="file_too_large")
    _, errors = parse_lines(content)
    if errors:
        shown = "; ".join(
            f"line {e.line}: {e.message}" if e.line else e.message
            for e in errors[:MAX_ERRORS_SHOWN]
        )
        more = f" (and {len(errors) - MAX_ERRORS_SHOWN} more)" if len(errors) > 5 else ""
        raise APIError(400, f"invalid batch file: {shown}{more}", param="file", code=errors[0].code)
    meta = {
        "id": f"file-{uuid.uuid4().hex}",
        "object": "file",
        "bytes": len(content),
        "created_at": int(time.time()),
        "filename": filename or "batch.jsonl",
        "purpose": "batch",
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }
    await store.put_file(meta, owner, content)
    return meta


@router.get("/v1/files/{file_id}")
@_store_errors
async def get_file(file_id: str, request: Request):
    store, _, owner = _store(request)
    meta = await store.file_meta(file_id, owner)
    if meta is None:
        raise _not_found("file", file_id)
    return meta


@router.get("/v1/files/{file_id}/content")
@_store_errors
async def file_content(file_id: str, request: Request):
    store, _, owner = _store(request)
    if await store.file_meta(file_id, owner) is None:
        raise _not_found("file", file_id)
    content = await store.file_content(file_id) or b""
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
@_store_errors
async def delete_file(file_id: str, request: Request):
    store, _, owner = _store(request)
    if await store.file_meta(file_id, owner) is None:
        raise _not_found("file", file_id)
    await store.delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field not honoured here is a 400

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


def batch_object(b: dict[str, str]) -> dict[str, Any]:
    """The OpenAI batch object of a stored batch."""
    obj = json.loads(b["obj"])
    errors = json.loads(b["errors"]) if b.get("errors") else None
    out = {
        **obj,
        "status": b["status"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "output_file_id": b.get("output_file_id"),
        "error_file_id": b.get("error_file_id"),
        "request_counts": {k: int(b.get(k, 0)) for k in ("total", "completed", "failed")},
    }
    for t in _TIMES:
        out[f"{t}_at"] = int(b[f"{t}_at"]) if f"{t}_at" in b else None
    return out


@router.post("/v1/batches")
@_store_errors
async def create_batch(body: CreateBatchRequest, request: Request):
    store, _, owner = _store(request)
    if body.endpoint not in ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
    try:
        window_s = parse_window(body.completion_window)
    except ValueError as e:
        raise bad_request(str(e), "completion_window") from None
    meta = await store.file_meta(body.input_file_id, owner)
    if meta is None:
        raise _not_found("file", body.input_file_id)
    if meta["purpose"] != "batch":
        raise bad_request('the input file\'s purpose must be "batch"', "input_file_id")
    now = int(time.time())
    obj = {
        "id": f"batch_{uuid.uuid4().hex}",
        "object": "batch",
        "endpoint": body.endpoint,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "created_at": now,
        "expires_at": now + window_s,
        "metadata": body.metadata,
    }
    await store.create_batch(obj, owner, owner)
    return batch_object(await store.batch(obj["id"]) or {})


async def _owned(store: BatchStore, bid: str, owner: str) -> dict[str, str]:
    b = await store.batch(bid)
    if b is None or b.get("owner") != owner:
        raise _not_found("batch", bid)
    return b


@router.get("/v1/batches/{batch_id}")
@_store_errors
async def get_batch(batch_id: str, request: Request):
    store, _, owner = _store(request)
    return batch_object(await _owned(store, batch_id, owner))


@router.get("/v1/batches")
@_store_errors
async def list_batches(
    request: Request, after: str | None = None, limit: int = Query(default=20, ge=1, le=100)
):
    store, _, owner = _store(request)
    ids = await store.batch_ids(owner)  # newest first
    if after is not None:
        ids = ids[ids.index(after) + 1 :] if after in ids else []
    data = [batch_object(b) for bid in ids[:limit] if (b := await store.batch(bid))]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ids) > limit,
    }


@router.post("/v1/batches/{batch_id}/cancel")
@_store_errors
async def cancel_batch(batch_id: str, request: Request):
    store, _, owner = _store(request)
    b = await _owned(store, batch_id, owner)
    moved = await store.move(batch_id, "cancelling", ("validating", "in_progress"))
    if not moved and b["status"] not in ("cancelling", "cancelled"):
        raise bad_request(f"a batch that is {b['status']} cannot be cancelled")
    return batch_object(await store.batch(batch_id) or b)
