"""Request state in Redis. Every Redis access of the scheduler goes through this module (its key
names and the append call's encoding live in state/keys.py).

Layout (format version 1), all keys `llmserve:<entity>:<id>`:
- `llmserve:request:<req_id>` hash: `v` (format version), `prompt` (JSON token ids), `params`
  (JSON sampling parameters, seed included), `priority`, `arrival_time`, `n`, `status`
  ("active" or "finished"), `finish_reasons` / `stop_reasons` (JSON lists, one per sequence),
  `error`, and `prompt_logprobs` (JSON list, prompt positions 1.., once computed; only when
  the request asked for them; written before the first token that carries them). Readers
  ignore fields they do not know, so this optional field keeps format version 1.
- `llmserve:tokens:<req_id>:<index>` list: output token ids of sequence `index`, in order.
- `llmserve:logprobs:<req_id>:<index>` list: one JSON entry per output token (only when the
  request asked for logprobs).
- `llmserve:index:unfinished` set: ids of requests a restarted scheduler must resume.
- `llmserve:abort:<req_id>` string, expiring (60 s by default): an abort that arrived before
  any request with that id existed (`abort_ahead`). Creating the request consumes it and stores
  the request already finished as aborted, so an abort never loses a race to its Generate,
  on this scheduler or on the next leader.
- `llmserve:health:probe` string: written by health checks to learn whether Redis accepts writes.
- `llmserve:executor:<instance_id>` string (JSON: address): an executor's registration, which
  expires unless its heartbeat renews it; `llmserve:index:executors` set: the registered ids.
  Executors write these (protos/executor_registry.md is the contract); this module only reads.

Appends carry the offset they start at and are applied by a server-side script that only adds
what is missing, so a write retried after a lost reply never duplicates a token.
"""

from __future__ import annotations

import json
import time
from typing import Any

from redis.exceptions import NoScriptError, RedisError, ResponseError

from scheduler_svc.core.request import FinishReason
from scheduler_svc.state.connect import (
    RedisTarget,
    connect,
    execute_acknowledged,
    wait_replicas,
)
from scheduler_svc.state.keys import (
    abort_key,
    executor_key,
    logprobs_key,
    pack_appends,
    request_key,
    tokens_key,
    tokens_key_bulk,
)
from scheduler_svc.state.leader import EPOCH_KEY
from scheduler_svc.state.records import (
    BASE_FIELDS,
    FORMAT_VERSION,
    Created,
    FinishRecord,
    StoredRequest,
    StoreFormatError,
    TokenAppend,
    decode_record,
)
from scheduler_svc.state.scripts import (
    ABORT_AHEAD_LUA,
    APPEND_LUA,
    BATCH_LUA,
    CREATE_LUA,
    FencedBatch,
)

# The records live in state/records.py; importers take them from here with the store.
__all__ = [
    "FORMAT_VERSION",
    "Created",
    "FinishRecord",
    "RequestStore",
    "StoreFenced",
    "StoreFormatError",
    "StoreGapError",
    "StoreUnavailable",
    "StoredRequest",
    "TokenAppend",
    "tokens_key_bulk",
]
UNFINISHED_KEY = "llmserve:index:unfinished"
EXECUTORS_KEY = "llmserve:index:executors"
HEALTH_PROBE_KEY = "llmserve:health:probe"


class StoreUnavailable(RuntimeError):
    """Redis cannot be reached; the caller buffers or refuses work until it returns."""


class StoreFenced(RuntimeError):
    """A write was refused: another scheduler holds the leader lease (a newer epoch)."""


class StoreGapError(RuntimeError):
    """Stored tokens are fewer than an append's offset (Redis lost data); resynchronise."""


MAX_CONNECTIONS = 256  # per scheduler process; Redis's own default limit is 10 000 clients
# How long a new request waits for --redis-min-replicas replicas to acknowledge it before it is
# refused (UNAVAILABLE); as long as an abort waits for its finish (engine/aborts.py).
CREATE_HOLD_S = 10.0


class RequestStore:
    """Async Redis-backed store of requests; raises StoreUnavailable when Redis is down."""

    def __init__(
        self,
        target: RedisTarget | str,
        *,
        finished_ttl_s: float = 3600.0,
        timeout_s: float = 2.0,
        min_replicas: int = 0,
        replica_timeout_ms: int = 500,
    ):
        self.target = RedisTarget(url=target) if isinstance(target, str) else target
        self.url = self.target.url
        self.finished_ttl_s = finished_ttl_s
        # Replicas that must acknowledge a write before its effect is released (`replicate`);
        # 0: none, nothing waits.
        self.min_replicas = min_replicas
        self.replica_timeout_ms = replica_timeout_ms
        self.create_hold_s = CREATE_HOLD_S
        # Release effects that fewer replicas acknowledged in time (--redis-degrade-unreplicated)
        # instead of holding them until enough do.
        self.release_unreplicated = False
        # A bounded pool that makes a call wait for a free connection (up to timeout_s) rather
        # than fail: redis-py's default pool refuses call 101 at once ("Too many connections"),
        # which a burst of concurrent aborts or creates reaches on a slow machine.
        self._redis = connect(
            self.target,
            timeout_s=timeout_s,
            max_connections=MAX_CONNECTIONS,
            retry_on_timeout=False,
        )
        self._append = self._redis.register_script(APPEND_LUA)
        self._create = self._redis.register_script(CREATE_LUA)
        self._batch = self._redis.register_script(BATCH_LUA)
        self._abort_ahead = self._redis.register_script(ABORT_AHEAD_LUA)
        # The leader epoch writes carry (scheduler_svc/state/leader.py); 0: no leader election,
        # nothing is fenced and writes go out exactly as before.
        self.epoch = 0

    @property
    def redis(self) -> Any:
        """The connection, for small keyspaces kept beside the requests (a feature's durable
        state, such as the adapters loaded live)."""
        return self._redis

    async def close(self) -> None:
        await self._redis.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    async def probe_write(self) -> str | None:
        """None when Redis accepts a write now, else why not (health checks use this: a Redis
        that answers PING may still refuse every write)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(HEALTH_PROBE_KEY, "1", px=60_000)
                _, acked = await execute_acknowledged(
                    pipe, self.min_replicas, self.replica_timeout_ms
                )
        except (RedisError, OSError) as e:
            return str(e) or type(e).__name__
        # Even idle: a new request would be held for the replicas (create), then refused.
        if acked < self.min_replicas and not self.release_unreplicated:
            return f"{acked} of {self.min_replicas} Redis replicas acknowledged a write"
        return None

    async def replicate(self) -> int:
        """How many replicas hold every write made so far (`connect.wait_replicas`), waiting up
        to replica_timeout_ms for min_replicas of them; raises StoreUnavailable."""
        try:
            return await wait_replicas(self._redis, self.min_replicas, self.replica_timeout_ms)
        except (RedisError, OSError) as e:
            raise _unavailable(e) from e

    async def create(self, rec: StoredRequest, *, honour_abort: bool = True) -> Created:
        """Store a new request unless the id exists. With `honour_abort`, an abort tombstone
        left for the id (`abort_ahead`) is consumed and the request stored finished as aborted
        (recovery's rewrites pass False: they restore requests that are running)."""
        key = request_key(rec.req_id)
        mapping = {
            "v": FORMAT_VERSION,
            "prompt": json.dumps(rec.prompt_token_ids),
            "params": json.dumps(rec.params),
            "priority": rec.priority,
            "arrival_time": repr(rec.arrival_time),
            "n": rec.n,
            "status": "active",
            "finish_reasons": json.dumps([None] * rec.n),
            "stop_reasons": json.dumps([None] * rec.n),
            "error": "",
        }
        for name, value in rec.features.items():  # the optional features' (None: nothing)
            if name in BASE_FIELDS:  # a feature's entry would overwrite the record's own field
                raise ValueError(f"feature field {name!r} is one of the record's own fields")
            if value is not None:
                mapping[name] = json.dumps(value)
        if rec.deadline:  # absent = none: records of earlier versions read the same
            mapping["deadline"] = repr(rec.deadline)
        if rec.trace_context:
            mapping["trace_context"] = rec.trace_context
        args: list[Any] = [
            self.epoch,
            rec.req_id,
            int(honour_abort),
            max(1, int(self.finished_ttl_s * 1000)),
            json.dumps([FinishReason.ABORT.value] * rec.n),
        ]
        for k, v in mapping.items():
            args.extend((k, v))
        keys = [key, UNFINISHED_KEY, EPOCH_KEY, abort_key(rec.req_id)]
        try:
            return await self._create_acknowledged(keys, args)
        except (RedisError, OSError) as e:
            raise _unavailable(e) from e

    async def _create_acknowledged(self, keys: list[str], args: list[Any]) -> Created:
        """The create script, repeated (it writes nothing the second time) until min_replicas
        replicas hold the record or create_hold_s passed (StoreUnavailable). The caller admits
        the request only after: a client that saw it accepted must find it after a failover,
        which a later step's barrier cannot promise once it reaches a new primary."""
        first = None
        deadline = time.monotonic() + self.create_hold_s
        while True:
            created, acked = await self._run_acknowledged(self._create, keys, args)
            first = Created(created) if first is None else first  # later runs say EXISTS
            if acked >= self.min_replicas or self.release_unreplicated:
                return first
            if time.monotonic() > deadline:
                raise StoreUnavailable(
                    f"{acked} of {self.min_replicas} Redis replicas acknowledged the request"
                )

    async def _run_acknowledged(self, script: Any, keys: list[str], args: list[Any]) -> tuple:
        """(`script`'s result, replicas that hold its writes): with min_replicas a WAIT follows
        it on the same connection (`connect.execute_acknowledged`)."""
        for attempt in range(2):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                try:
                    results, acked = await execute_acknowledged(
                        pipe, self.min_replicas, self.replica_timeout_ms
                    )
                    return results[0], acked
                except NoScriptError:  # a restarted or promoted Redis without the script
                    if attempt:
                        raise
                    await self._redis.script_load(script.script)
        raise AssertionError("unreachable")

    async def abort_ahead(self, req_id: str, ttl_s: float) -> str | None:
        """The stored status of `req_id` ("active" or "finished"), or None when it is not
        stored: then a tombstone is left for `ttl_s` so that a request created with this id
        in that time is stored finished as aborted (see `create`)."""
        keys = [request_key(req_id), abort_key(req_id), EPOCH_KEY]
        args = [self.epoch, max(1, int(ttl_s * 1000))]
        try:
            status, acked = await self._run_acknowledged(self._abort_ahead, keys, args)
        except (RedisError, OSError) as e:
            raise _unavailable(e) from e
        status = status.decode() if isinstance(status, bytes) else str(status)
        if status != "tombstoned":
            return status
        # The answer tells the client the abort will win: the tombstone must survive failover.
        if acked < self.min_replicas and not self.release_unreplicated:
            raise StoreUnavailable(
                f"{acked} of {self.min_replicas} Redis replicas acknowledged the abort"
            )
        return None

    async def write_step(
        self,
        appends: list[TokenAppend],
        finishes: list[FinishRecord],
        prompt_logprobs: list[tuple[str, list[Any]]] = (),  # type: ignore[assignment]
    ) -> None:
        """One engine step: prompt logprobs (before the first tokens that carry them), every
        append in one script call, then finish records."""
        appends = [a for a in appends if a.token_ids]
        if not appends and not finishes and not prompt_logprobs:
            return
        try:
            if prompt_logprobs:
                batch = self._new_batch()
                for req_id, entries in prompt_logprobs:
                    batch.hset(request_key(req_id), "prompt_logprobs", json.dumps(entries))
                await self._send_batch(batch)
            results: list[int] = []
            if appends:
                packed = pack_appends(self._append.sha, appends, self.epoch)
                results = await self._run_append(packed)
            if finishes:
                batch = self._new_batch()
                for f in finishes:
                    self._queue_finish(batch, f)
                await self._send_batch(batch)
        except (RedisError, OSError) as e:
            # Not only lost connections: a Redis that refuses writes (READONLY replica, OOM,
            # MISCONF, NOREPLICAS, BUSY script) is as unavailable to us as one that is down.
            raise _unavailable(e) from e
        for a, res in zip(appends, results, strict=True):
            if res == -1:
                raise StoreGapError(f"stored tokens of {a.req_id}/{a.index} end before {a.offset}")

    async def _run_append(self, packed: bytes) -> list[int]:
        """Send a pre-packed EVALSHA of the append script on a connection of the pool.

        The step's command is packed here (`keys.pack_appends`) rather than by redis-py, whose
        per-argument packing costs more scheduler CPU than the rest of the write together.
        """
        pool = self._redis.connection_pool
        for attempt in range(2):
            conn = await pool.get_connection()
            try:
                await conn.send_packed_command(packed)
                return await conn.read_response()
            except NoScriptError:
                if attempt:
                    raise
                # A restarted Redis forgot the script: load it and send the command again.
                await self._redis.script_load(APPEND_LUA)
            except BaseException:
                await conn.disconnect()
                raise
            finally:
                await pool.release(conn)
        raise AssertionError("unreachable")

    def _queue_finish(self, pipe: Any, f: FinishRecord) -> None:
        key = request_key(f.req_id)
        pipe.hset(
            key,
            mapping={
                "status": "finished",
                "finish_reasons": json.dumps(f.finish_reasons),
                "stop_reasons": json.dumps(f.stop_reasons),
                "error": f.error,
            },
        )
        pipe.srem(UNFINISHED_KEY, f.req_id)
        ttl_ms = max(1, int(self.finished_ttl_s * 1000))
        pipe.pexpire(key, ttl_ms)
        for i in range(f.n):
            pipe.pexpire(tokens_key(f.req_id, i), ttl_ms)
            pipe.pexpire(logprobs_key(f.req_id, i), ttl_ms)

    async def rewrite_outputs(self, req_id: str, outputs: list[list[int]]) -> None:
        """Replace stored tokens with `outputs` (after Redis lost data it had acknowledged)."""
        try:
            batch = self._new_batch(transaction=True)
            for i, toks in enumerate(outputs):
                batch.delete(tokens_key(req_id, i))
                if toks:
                    batch.rpush(tokens_key(req_id, i), *toks)
            await self._send_batch(batch)
        except (RedisError, OSError) as e:
            raise _unavailable(e) from e

    def _new_batch(self, *, transaction: bool = False) -> Any:
        """Where a group of writes is queued: a redis-py pipeline, or under leader election a
        recorder sent as one fenced script call (atomic, like a transaction)."""
        if self.epoch:
            return FencedBatch()
        return self._redis.pipeline(transaction=transaction)

    async def _send_batch(self, batch: Any) -> None:
        if isinstance(batch, FencedBatch):
            await self._batch(keys=[EPOCH_KEY], args=[self.epoch, *batch.args])
        else:
            async with batch as pipe:
                await pipe.execute()

    async def get(self, req_id: str, *, from_index: int = 0) -> StoredRequest | None:
        """The stored request with outputs from `from_index` on; None if unknown or expired."""
        try:
            fields = await self._redis.hgetall(request_key(req_id))
            if not fields:
                return None
            rec = decode_record(req_id, fields)
            async with self._redis.pipeline(transaction=False) as pipe:
                for i in range(rec.n):
                    pipe.lrange(tokens_key(req_id, i), from_index, -1)
                    pipe.lrange(logprobs_key(req_id, i), from_index, -1)
                lists = await pipe.execute()
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis unavailable: {e}") from e
        rec.outputs = [[int(t) for t in lists[2 * i]] for i in range(rec.n)]
        rec.logprobs = [[json.loads(x) for x in lists[2 * i + 1]] for i in range(rec.n)]
        return rec

    async def list_executors(self) -> list[tuple[str, str]]:
        """(instance_id, address) of every executor whose registration is alive."""
        try:
            ids = sorted(m.decode() for m in await self._redis.smembers(EXECUTORS_KEY))
            if not ids:
                return []
            values = await self._redis.mget([executor_key(i) for i in ids])
            gone = [i for i, v in zip(ids, values, strict=True) if v is None]
            if gone:  # expired: the executor stopped renewing it
                await self._redis.srem(EXECUTORS_KEY, *gone)
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis unavailable: {e}") from e
        return [
            (i, json.loads(v)["address"]) for i, v in zip(ids, values, strict=True) if v is not None
        ]

    async def exists(self, req_id: str) -> bool:
        try:
            return bool(await self._redis.exists(request_key(req_id)))
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis unavailable: {e}") from e

    async def list_unfinished(self) -> list[StoredRequest]:
        """Every request a restarted scheduler must resume, oldest first."""
        try:
            ids = sorted(m.decode() for m in await self._redis.smembers(UNFINISHED_KEY))
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"redis unavailable: {e}") from e
        out = []
        for req_id in ids:
            rec = await self.get(req_id)
            if rec is not None and not rec.finished:
                out.append(rec)
        out.sort(key=lambda r: r.arrival_time)
        return out


def _unavailable(e: BaseException) -> Exception:
    """The store's error for a failed Redis call: fenced off, or unavailable."""
    if isinstance(e, ResponseError) and str(e).startswith("FENCED"):
        return StoreFenced(str(e))
    return StoreUnavailable(f"redis unavailable: {e}")
