"""The batch runner inside every frontend: claims active batches with a lease in Redis and runs
their lines as ordinary requests of this frontend's own routes.

Why it survives kill -9 of any component with every output what it would have been:
- A line is sent with a request id fixed by its batch and position (`<batch id>-<index>`). The
  scheduler never starts a second generation for an id it has stored: a runner that takes over
  after a crash sends the line again and is attached to the same request, replayed from its
  first token, so its output is the one the first attempt would have had (greedy or seeded).
  Embedding lines are recomputed (the scheduler stores nothing of them); they are deterministic.
- A line's result is recorded once (HSETNX, store.record) and counted with it, so a line never
  appears twice in the output, however many runners sent it.
- A runner holds a batch only while its lease is renewed; a killed frontend's batches are taken
  over by any frontend (itself restarted included) once the lease lapses.
Lines go through the same ASGI app as interactive calls (in process, no socket): the same
validation, sampling and response shape, so a batch line's body equals the interactive one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import httpx
import structlog

from frontend_svc.batch.lines import ABORTABLE, BatchLine, parse_lines
from frontend_svc.batch.settings import BatchSettings, key_fingerprint
from frontend_svc.batch.store import FINAL, BatchStore

log = structlog.get_logger(__name__)

# Answers that mean "not now" (scheduler away past the resume timeout, queue full): sent again.
_RETRY = {429, 502, 503, 504}
_ENDING_CODE = {"expired": "batch_expired", "cancelled": "batch_cancelled"}


def request_id(bid: str, index: int) -> str:
    return f"{bid}-{index}"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class BatchRunner:
    def __init__(self, store: BatchStore, app: Any, settings: BatchSettings, api_keys: list[str]):
        self.store, self.app, self.settings = store, app, settings
        self.holder = uuid.uuid4().hex  # this runner's name on the leases it holds
        self.running: dict[str, asyncio.Task] = {}
        self._keys = {key_fingerprint(k): k for k in api_keys}
        self._foreign: set[str] = set()  # batches of keys this frontend lacks (logged once)
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        # raise_app_exceptions=False: the app answers 500 for a bug; the line records it.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self._http = httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None)
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        """Stop running (the lines already sent keep running in the scheduler; whoever claims
        the batch next attaches to them) and hand the leases back at once."""
        tasks = [t for t in (self._loop_task, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.settings.lease_s * 1000))

    async def _loop(self) -> None:
        while True:
            try:
                for bid in await self.store.active_ids():
                    if bid in self._foreign:
                        continue
                    if bid not in self.running and await self.store.claim(
                        bid, self.holder, self._lease_ms
                    ):
                        task = asyncio.get_running_loop().create_task(self._hold(bid))
                        self.running[bid] = task
                        task.add_done_callback(lambda _, b=bid: self.running.pop(b, None))
            except Exception as e:  # Redis away: look again next round
                log.warning("batch.poll_failed", error=str(e))
            await asyncio.sleep(self.settings.poll_s)

    async def _hold(self, bid: str) -> None:
        """Run the batch while renewing its lease; stop at once if the lease is lost."""
        log.info("batch.claimed", batch_id=bid, holder=self.holder)
        work = asyncio.get_running_loop().create_task(self._run(bid))
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=self.settings.lease_s / 3)
                if work.done():
                    break
                try:
                    held = await self.store.renew(bid, self.holder, self._lease_ms)
                except Exception:
                    held = False
                if not held:
                    log.warning("batch.lease_lost", batch_id=bid)
                    break
            if work.done() and not work.cancelled() and work.exception() is not None:
                log.error("batch.failed_run", batch_id=bid, error=repr(work.exception()))
        finally:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            with contextlib.suppress(Exception):  # else the lease lapses by itself
                await self.store.release(bid, self.holder)

    async def _run(self, bid: str) -> None:
        b = await self.store.batch(bid)
        if b is None or b["status"] in FINAL:  # gone, or final but still listed (a crash)
            await self.store.forget_active(bid)
            return
        if b["key_fp"] and b["key_fp"] not in self._keys:
            # Made with a key this frontend was not given: another frontend must run it (the
            # lines belong to that key on the scheduler; acting with another would be wrong).
            if bid not in self._foreign:
                self._foreign.add(bid)
                log.warning("batch.key_unknown_here", batch_id=bid)
            return
        obj = json.loads(b["obj"])
        if b["status"] == "validating":
            await self._validate(bid, obj)
            b = await self.store.batch(bid) or b
        status, ending = b["status"], b.get("ending", "completed")
        if status == "in_progress":
            ending = await self._run_lines(bid, obj, b["key_fp"])
            if ending != "cancelled":
                await self.store.move(bid, "finalizing", ("in_progress",), ending=ending)
            status = await self.store.status(bid)
        if status == "cancelling":
            ending = "cancelled"
        if status in ("finalizing", "cancelling"):
            await self._finalize(bid, obj, status, ending)

    async def _lines(self, obj: dict[str, Any]) -> list[BatchLine]:
        content = await self.store.file_content(obj["input_file_id"]) or b""
        return parse_lines(content)[0]

    async def _validate(self, bid: str, obj: dict[str, Any]) -> None:
        content = await self.store.file_content(obj["input_file_id"])
        if content is None:
            errors = [{"code": "file_not_found", "message": "the input file is gone"}]
            await self.store.move(bid, "failed", ("validating",), errors=_dumps(errors))
            return
        lines, errors = parse_lines(content)
        if errors:
            data = _dumps([e.to_dict() for e in errors])
            await self.store.move(bid, "failed", ("validating",), errors=data)
            return
        await self.store.move(bid, "in_progress", ("validating",), total=len(lines))

    async def _run_lines(self, bid: str, obj: dict[str, Any], key_fp: str) -> str:
        """Run every line without a result; "completed", or "expired"/"cancelled" when the
        window ends or a cancel comes first (the lines in flight are then aborted)."""
        key = self._keys.get(key_fp)
        done = await self.store.done_indices(bid)
        todo = [ln for ln in await self._lines(obj) if ln.index not in done]
        in_flight: dict[int, BatchLine] = {}

        async def one(line: BatchLine) -> None:
            async with self._slots:
                in_flight[line.index] = line
                try:
                    text, ok = await self._call(bid, line, key, obj["expires_at"])
                    await self.store.record(bid, line.index, text, ok)
                finally:
                    in_flight.pop(line.index, None)

        loop = asyncio.get_running_loop()
        pending = {loop.create_task(one(ln)) for ln in todo}
        ending = "completed"
        try:
            while pending:
                done_now, pending = await asyncio.wait(pending, timeout=self.settings.poll_s)
                for t in done_now:
                    if t.exception() is not None:
                        raise t.exception()  # Redis away: the lease lapses, another resumes
                if pending and time.time() >= obj["expires_at"]:
                    ending = "expired"
                elif pending and await self.store.status(bid) == "cancelling":
                    ending = "cancelled"
                else:
                    continue
                lines = list(in_flight.values())
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                await self._abort(bid, lines, key)
                pending = set()
        finally:
            for t in pending:  # lease lost or an error: leave the requests to the next runner
                t.cancel()
        log.info("batch.lines_done", batch_id=bid, ending=ending)
        return ending

    async def _call(
        self, bid: str, line: BatchLine, key: str | None, expires_at: float
    ) -> tuple[str, bool]:
        """One line through the app's own route: (its output line, whether it answered 200)."""
        rid = request_id(bid, line.index)
        headers = {"x-request-id": rid, "content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        body = _dumps({**line.body, "priority": self.settings.priority})
        delay = 0.1
        while True:
            resp = await self._http.post(line.url, content=body, headers=headers)
            if resp.status_code not in _RETRY or time.time() + delay >= expires_at:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        try:
            payload = resp.json()
        except ValueError:
            payload = {"error": {"message": resp.text[:1000], "type": "server_error"}}
        out = {
            "id": f"batch_req_{rid.removeprefix('batch_')}",
            "custom_id": line.custom_id,
            "response": {"status_code": resp.status_code, "request_id": rid, "body": payload},
            "error": None,
        }
        return _dumps(out), resp.status_code == 200

    async def _abort(self, bid: str, lines: list[BatchLine], key: str | None) -> None:
        """Abort the scheduler requests of lines cut short (lines.ABORTABLE: some have none)."""
        client = self.app.state.frontend.client_for(key)
        for line in lines:
            if line.url not in ABORTABLE:
                continue
            base, n = request_id(bid, line.index), line.body.get("n") or 1
            for rid in [base] if n == 1 else [f"{base}-{i}" for i in range(int(n))]:
                try:
                    await client.abort(rid)
                except Exception as e:  # gone or never started: nothing to stop
                    log.info("batch.abort_skipped", request_id=rid, error=str(e))

    async def _finalize(self, bid: str, obj: dict[str, Any], status: str, ending: str) -> None:
        """The output and error files, in input order, then the final status. Their ids are
        fixed by the batch's, so a runner that dies here and one that redoes it agree."""
        results = await self.store.results(bid)
        out, err = [], []
        for line in await self._lines(obj):
            text = results.get(line.index)
            if text is None:  # never ran: the window ended or a cancel came first
                code = _ENDING_CODE.get(ending, "batch_incomplete")
                message = f"the batch ended ({ending}) before this request ran"
                text = _dumps(
                    {
                        "id": f"batch_req_{request_id(bid, line.index).removeprefix('batch_')}",
                        "custom_id": line.custom_id,
                        "response": None,
                        "error": {"code": code, "message": message},
                    }
                )
                err.append(text)
            elif json.loads(text)["response"]["status_code"] == 200:
                out.append(text)
            else:
                err.append(text)
        owner = (await self.store.batch(bid) or {}).get("owner", "")
        fields = {}
        for kind, rows in (("output", out), ("error", err)):
            if rows or kind == "output":
                fid = await self._put_result_file(bid, kind, rows, owner)
                fields[f"{kind}_file_id"] = fid
        await self.store.move(bid, ending, (status,), **fields)
        log.info("batch.finished", batch_id=bid, status=ending, lines=len(out) + len(err))

    async def _put_result_file(self, bid: str, kind: str, rows: list[str], owner: str) -> str:
        fid = f"file-{bid.removeprefix('batch_')}-{kind}"
        content = "".join(r + "\n" for r in rows).encode()
        meta = {
            "id": fid,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": f"{bid}_{kind}.jsonl",
            "purpose": "batch_output",
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        await self.store.put_file(meta, owner, content)
        return fid
