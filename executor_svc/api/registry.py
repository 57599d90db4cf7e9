"""The executor's side of the executor registry in Redis (contract: protos/executor_registry.md).

An executor started with `--redis-url` announces the address schedulers can dial and keeps the
announcement alive with a heartbeat; schedulers started with `--discover-executors` read the
registry (scheduler_svc/state/store.py, `RequestStore.list_executors`). The two sides share the
written contract, not code.
"""

from __future__ import annotations

import json
import threading

from redis.exceptions import RedisError

from executor_svc.api.redis_conn import connect

__all__ = ["EXECUTORS_KEY", "ExecutorRegistration", "executor_key"]

# The layout, exactly as protos/executor_registry.md writes it down.
EXECUTORS_KEY = "llmserve:index:executors"


def executor_key(instance_id: str) -> str:
    return f"llmserve:executor:{instance_id}"


class ExecutorRegistration:
    """An executor's entry in the registry, kept alive by a heartbeat thread.

    The executor process has no event loop of its own to spare, so this uses the synchronous
    client. The entry expires `ttl_s` after the last heartbeat: an executor that dies drops out
    of the registry by itself; one that stops cleanly removes it at once.
    """

    def __init__(
        self,
        url: str | None,
        instance_id: str,
        address: str,
        *,
        ttl_s: float = 10.0,
        interval_s: float = 2.0,
        sentinels: tuple[tuple[str, int], ...] = (),
        sentinel_master: str = "mymaster",
        sentinel_password: str | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.address = address
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.interval_s = interval_s
        self._redis = connect(url, sentinels, sentinel_master, sentinel_password=sentinel_password)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.healthy = False

    def beat(self) -> bool:
        """Write (or renew) the entry once; False while Redis cannot be reached."""
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(
                executor_key(self.instance_id),
                json.dumps({"address": self.address}),
                px=self.ttl_ms,
            )
            pipe.sadd(EXECUTORS_KEY, self.instance_id)
            pipe.execute()
        except (RedisError, OSError):
            self.healthy = False
            return False
        self.healthy = True
        return True

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        """Stop the heartbeat and remove the entry (best effort: it expires anyway)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(executor_key(self.instance_id))
            pipe.srem(EXECUTORS_KEY, self.instance_id)
            pipe.execute()
        except (RedisError, OSError):
            pass
        self._redis.close()
