"""Files and batches in Redis, the same Redis the scheduler keeps requests in: one durable
store with one high-availability story (replicas, Sentinel), so a batch survives whatever the
request state survives. Files are kept whole in one hash field, which is why uploads are capped
(`--batch-max-file-mb`).

Keys (all `llmserve:`):
- `file:<id>` hash: `meta` (the OpenAI file object, JSON), `owner`, `content` (the bytes).
- `batch:<id>` hash: `obj` (the fixed part of the batch object, JSON), `owner`, `key_fp` (which
  API key runs it; a digest, never the key), `status`, one `<status>_at` per transition,
  `total`/`completed`/`failed`, `errors`, `output_file_id`, `error_file_id`.
- `batch:<id>:results` hash: line index -> the output line (JSON). Written with HSETNX and the
  counter in one script: a line's result is recorded, and counted, exactly once.
- `batch:<id>:lease` string: the runner that holds the batch (SET NX PX, renewed while it runs).
- `batches:active` set: batches not yet in a final state (what runners look for).
- `batches:owner:<owner>` list: the owner's batch ids, newest first (`GET /v1/batches`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis

__all__ = ["ACTIVE", "FINAL", "BatchStore", "NotReplicated"]

P = "llmserve:"
FINAL = frozenset({"completed", "failed", "expired", "cancelled"})
ACTIVE = P + "batches:active"
BARRIER = P + "batches:barrier"


class NotReplicated(Exception):
    """Fewer replicas than asked acknowledged a write within the timeout."""


# KEYS: batch, results. ARGV: index, line, counter field. 1 when this call recorded it.
_RECORD = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
  return 1
end
return 0
"""
# KEYS: batch. ARGV: new status, now, field/value pairs..., then the allowed current statuses
# after a '|' marker. The status moves only from one of those (a cancel never revives a batch
# that finished; a finished one never goes back).
_MOVE = """
local cur = redis.call('HGET', KEYS[1], 'status')
local i = 3
local sets = {}
while ARGV[i] ~= '|' do sets[#sets + 1] = ARGV[i]; i = i + 1 end
local ok = false
for j = i + 1, #ARGV do if ARGV[j] == cur then ok = true end end
if not ok then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
if #sets > 0 then redis.call('HSET', KEYS[1], unpack(sets)) end
return 1
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class BatchStore:
    """The Batch API's only reader and writer of Redis."""

    def __init__(
        self, redis: aioredis.Redis, min_replicas: int = 0, replica_timeout_ms: int = 1000
    ) -> None:
        self.redis = redis
        self.min_replicas, self.replica_timeout_ms = min_replicas, replica_timeout_ms
        self._record = redis.register_script(_RECORD)
        self._move = redis.register_script(_MOVE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def close(self) -> None:
        await self.redis.aclose()

    async def replicated(self) -> None:
        """Return once `min_replicas` replicas hold every write made so far (by any connection):
        WAIT counts its own connection's last write, so a barrier write goes first on the same
        connection, and the replication stream is ordered. NotReplicated when too few did."""
        if self.min_replicas == 0:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.incr(BARRIER)
            pipe.execute_command("WAIT", self.min_replicas, self.replica_timeout_ms)
            _, acked = await pipe.execute()
        if acked < self.min_replicas:
            raise NotReplicated(f"{acked} of {self.min_replicas} replicas acknowledged the write")

    # files

    async def put_file(self, meta: dict[str, Any], owner: str, content: bytes) -> None:
        await self.redis.hset(
            f"{P}file:{meta['id']}",
            mapping={"meta": json.dumps(meta), "owner": owner, "content": content},
        )
        await self.replicated()

    async def file_meta(self, file_id: str, owner: str) -> dict[str, Any] | None:
        """The file object, or None when there is none of this owner's by that id."""
        meta, who = await self.redis.hmget(f"{P}file:{file_id}", ["meta", "owner"])
        if meta is None or _s(who) != owner:
            return None
        return json.loads(meta)

    async def file_content(self, file_id: str) -> bytes | None:
        return await self.redis.hget(f"{P}file:{file_id}", "content")

    async def delete_file(self, file_id: str) -> None:
        await self.redis.delete(f"{P}file:{file_id}")

    # batches

    async def create_batch(self, obj: dict[str, Any], owner: str, key_fp: str) -> None:
        bid = obj["id"]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                f"{P}batch:{bid}",
                mapping={
                    "obj": json.dumps(obj),
                    "owner": owner,
                    "key_fp": key_fp,
                    "status": "validating",
                    "completed": 0,
                    "failed": 0,
                    "total": 0,
                },
            )
            pipe.sadd(ACTIVE, bid)
            pipe.lpush(f"{P}batches:owner:{owner}", bid)
            await pipe.execute()
        await self.replicated()

    async def batch(self, bid: str) -> dict[str, str] | None:
        """The batch's hash as text fields, or None."""
        raw = await self.redis.hgetall(f"{P}batch:{bid}")
        return {_s(k): _s(v) for k, v in raw.items()} if raw else None

    async def status(self, bid: str) -> str | None:
        v = await self.redis.hget(f"{P}batch:{bid}", "status")
        return _s(v) if v is not None else None

    async def batch_ids(self, owner: str) -> list[str]:
        return [_s(b) for b in await self.redis.lrange(f"{P}batches:owner:{owner}", 0, -1)]

    async def move(self, bid: str, to: str, allowed: tuple[str, ...], **fields: Any) -> bool:
        """Status `to` (and `fields`) if the status is one of `allowed`; whether it moved."""
        sets = [str(x) for kv in fields.items() for x in kv]
        args = [to, int(time.time()), *sets, "|", *allowed]
        moved = bool(await self._move(keys=[f"{P}batch:{bid}"], args=args))
        if moved and to in FINAL:
            await self.forget_active(bid)
        if moved and (to in FINAL or to == "cancelling"):
            await self.replicated()  # what a client is told
        return moved

    async def set_fields(self, bid: str, **fields: Any) -> None:
        await self.redis.hset(f"{P}batch:{bid}", mapping={k: str(v) for k, v in fields.items()})

    async def forget_active(self, bid: str) -> None:
        await self.redis.srem(ACTIVE, bid)

    async def active_ids(self) -> list[str]:
        return sorted(_s(b) for b in await self.redis.smembers(ACTIVE))

    # results

    async def record(self, bid: str, index: int, line: str, ok: bool) -> bool:
        """Keep the first result of line `index` and count it; False when one was kept before."""
        keys = [f"{P}batch:{bid}", f"{P}batch:{bid}:results"]
        return bool(
            await self._record(keys=keys, args=[index, line, "completed" if ok else "failed"])
        )

    async def results(self, bid: str) -> dict[int, str]:
        raw = await self.redis.hgetall(f"{P}batch:{bid}:results")
        return {int(k): _s(v) for k, v in raw.items()}

    async def done_indices(self, bid: str) -> set[int]:
        return {int(k) for k in await self.redis.hkeys(f"{P}batch:{bid}:results")}

    # leases

    async def claim(self, bid: str, holder: str, lease_ms: int) -> bool:
        return bool(await self.redis.set(f"{P}batch:{bid}:lease", holder, nx=True, px=lease_ms))

    async def renew(self, bid: str, holder: str, lease_ms: int) -> bool:
        return bool(await self._renew(keys=[f"{P}batch:{bid}:lease"], args=[holder, lease_ms]))

    async def release(self, bid: str, holder: str) -> None:
        await self._release(keys=[f"{P}batch:{bid}:lease"], args=[holder])
