"""The leader lease: several schedulers on one Redis, one of them serving (`--leader-election`).

- `llmserve:leader` holds the leader's node id (one per process start) and expires `ttl_s`
  after the last renewal; the leader renews it every `renew_s`.
- `llmserve:leader:epoch` counts takeovers. Taking the lease increments it; the new value is
  the leader's epoch. Every write of request state carries it and a server-side check refuses
  writes from an older epoch (scheduler_svc/state/store.py), and executors refuse steps from
  one (ExecuteModelRequest.leader_epoch): a leader that was only paused or cut off, and comes
  back after a standby took over, cannot change anything. It notices and steps down.

Standbys try to take the lease every `poll_s`; with the defaults a dead leader is replaced
within ttl_s + poll_s = 2.25 s, before recovery starts.

With replicas (`min_replicas`, --redis-min-replicas) a new leader starts serving only once that
many replicas acknowledged its epoch bump (`connect.wait_replicas`): a replica promoted by
Sentinel then holds the newest epoch, so the fencing scripts on the new primary still refuse
every deposed leader. A renewal needs no barrier: a renewal lost in a failover only makes the
lease expire sooner on the new primary, and whoever takes it then bumps the epoch again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import structlog
from redis.exceptions import RedisError

from scheduler_svc.state.connect import RedisTarget, connect, wait_replicas

log = structlog.get_logger(__name__)

__all__ = ["EPOCH_KEY", "LEADER_KEY", "LeaderLease"]

LEADER_KEY = "llmserve:leader"
EPOCH_KEY = "llmserve:leader:epoch"

# KEYS: leader, epoch. ARGV: node id, ttl ms. Returns the new epoch, or 0 if another holds it.
_ACQUIRE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# KEYS: leader, epoch. ARGV: node id, ttl ms, epoch. 1 if still ours (renewed), else 0.
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: leader. ARGV: node id. Gives the lease up at once (clean shutdown).
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaderLease:
    def __init__(
        self,
        target: RedisTarget | str,
        *,
        ttl_s: float = 2.0,
        renew_s: float = 0.5,
        poll_s: float = 0.25,
        min_replicas: int = 0,
        replica_timeout_ms: int = 500,
        release_unreplicated: bool = False,
    ) -> None:
        if not 0 < renew_s < ttl_s:
            raise ValueError("the lease must be renewed more often than it expires")
        self.node_id = uuid.uuid4().hex
        self.ttl_ms = int(ttl_s * 1000)
        self.ttl_s, self.renew_s, self.poll_s = ttl_s, renew_s, poll_s
        self.epoch = 0
        self.min_replicas = min_replicas
        self.replica_timeout_ms = replica_timeout_ms
        self.release_unreplicated = release_unreplicated
        self._redis = connect(target, timeout_s=max(0.2, renew_s))
        self._acquire = self._redis.register_script(_ACQUIRE_LUA)
        self._renew = self._redis.register_script(_RENEW_LUA)
        self._release = self._redis.register_script(_RELEASE_LUA)

    async def acquire(self) -> int:
        """Wait until this process holds the lease; returns its epoch."""
        logged = False
        while True:
            try:
                epoch = int(
                    await self._acquire(
                        keys=[LEADER_KEY, EPOCH_KEY], args=[self.node_id, self.ttl_ms]
                    )
                )
            except (RedisError, OSError) as e:
                log.warning("leader.redis_unavailable", error=str(e))
                epoch = 0
            if epoch and await self._epoch_replicated(epoch):
                self.epoch = epoch
                log.info("leader.elected", epoch=epoch, node=self.node_id)
                return epoch
            if not logged:
                log.info("leader.standby", node=self.node_id)
                logged = True
            await asyncio.sleep(self.poll_s)

    async def _epoch_replicated(self, epoch: int) -> bool:
        """Whether min_replicas replicas hold the epoch bump (and lease) just written; keeps
        the lease renewed while waiting for them, for up to one lease lifetime."""
        if not self.min_replicas:
            return True
        deadline = time.monotonic() + self.ttl_s
        while time.monotonic() < deadline:
            try:
                acked = await wait_replicas(self._redis, self.min_replicas, self.replica_timeout_ms)
                if acked >= self.min_replicas:
                    return True
                log.warning("leader.epoch_unreplicated", epoch=epoch, acked=acked,
                            needed=self.min_replicas)  # fmt: skip
                if self.release_unreplicated:
                    return True
                args = [self.node_id, self.ttl_ms, epoch]
                if not await self._renew(keys=[LEADER_KEY, EPOCH_KEY], args=args):
                    return False
            except (RedisError, OSError) as e:
                log.warning("leader.redis_unavailable", error=str(e))
            await asyncio.sleep(self.poll_s)
        return False

    async def hold(self) -> str:
        """Renew the lease until it is lost; returns why. A renewal that cannot reach Redis
        is retried, but once the lease may have expired (ttl_s since the last renewal) another
        scheduler may hold it: that counts as lost too."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                ok = await self._renew(
                    keys=[LEADER_KEY, EPOCH_KEY], args=[self.node_id, self.ttl_ms, self.epoch]
                )
            except (RedisError, OSError) as e:
                if time.monotonic() - last_ok >= self.ttl_s:
                    return f"could not renew the lease for {self.ttl_s} s: {e}"
                continue
            if not ok:
                return "another scheduler took the lease"
            last_ok = time.monotonic()

    async def release(self) -> None:
        with contextlib.suppress(RedisError, OSError):  # it expires anyway
            await self._release(keys=[LEADER_KEY], args=[self.node_id])

    async def close(self) -> None:
        await self._redis.aclose()
