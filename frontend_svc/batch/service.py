"""The Batch API's part of a frontend's life: its Redis store and runner, opened with the app's
lifespan and closed with it."""

from __future__ import annotations

from typing import Any

from frontend_svc.batch.redis_conn import connect
from frontend_svc.batch.runner import BatchRunner
from frontend_svc.batch.settings import BatchSettings
from frontend_svc.batch.store import BatchStore


async def open_batches(
    app: Any, settings: BatchSettings, api_keys: list[str]
) -> BatchRunner | None:
    """With Redis configured: `app.state.batch_store` set and a runner started (returned, for
    `close()`); else None, and the routes answer 503."""
    app.state.batch_settings = settings
    app.state.batch_store = None
    if not settings.enabled:
        return None
    redis = connect(
        settings.redis_url,
        settings.sentinels,
        settings.sentinel_master,
        sentinel_password=settings.sentinel_password,
    )
    store = BatchStore(redis, settings.min_replicas, settings.replica_timeout_ms)
    app.state.batch_store = store
    runner = BatchRunner(store, app, settings, api_keys)
    runner.start()
    return runner


async def close_batches(app: Any, runner: BatchRunner | None) -> None:
    if runner is not None:
        await runner.close()
    store = getattr(app.state, "batch_store", None)
    if store is not None:
        await store.close()
