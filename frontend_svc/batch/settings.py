"""The Batch API's settings (a field of FrontendConfig, built from the `batch` flags)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchSettings:
    redis_url: str | None = None  # None and no Sentinels: the Batch API answers 503
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str = "mymaster"
    sentinel_password: str | None = None
    min_replicas: int = 0  # replicas that acknowledge (WAIT) what a client is told is stored
    replica_timeout_ms: int = 1000
    max_file_bytes: int = 32 * 2**20  # a file lives whole in one Redis hash field
    max_concurrency: int = 16  # lines of one runner in flight at once (all its batches)
    priority: int = -1  # below interactive requests' default 0 (scheduler --policy priority)
    lease_s: float = 10.0  # a killed runner's batches are taken over this long after
    poll_s: float = 1.0  # how often a runner looks for batches to claim and for cancels

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url or self.sentinels)


def key_fingerprint(api_key: str | None) -> str:
    """Who owns a file or batch: a digest of the caller's API key ("" with keys off). Redis
    never holds a key itself; a frontend finds the key to run a batch with among its own."""
    if not api_key:
        return ""
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]
