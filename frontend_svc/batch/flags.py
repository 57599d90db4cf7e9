"""The frontend's `batch` flags and the settings made of them."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from frontend_svc.batch.redis_conn import parse_sentinels
from frontend_svc.batch.settings import BatchSettings


def _sentinels(text: str) -> tuple[tuple[str, int], ...]:
    try:
        return parse_sentinels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_batch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch", "the Batch API (/v1/files, /v1/batches); needs Redis")
    g.add_argument(
        "--redis-url",
        help="the Redis holding files and batches (the scheduler's own); without it or "
        "--redis-sentinel the Batch API answers 503",
    )
    g.add_argument(
        "--redis-sentinel",
        type=_sentinels,
        help="host:port[,host:port...] of Sentinels naming the primary, as the scheduler's "
        "(default $LLMSERVE_REDIS_SENTINEL)",
    )
    g.add_argument(
        "--redis-sentinel-master",
        help="the primary's name (default $LLMSERVE_REDIS_SENTINEL_MASTER or mymaster)",
    )
    g.add_argument(
        "--redis-min-replicas",
        type=int,
        help="replicas that must acknowledge (WAIT) an upload, a new batch, a cancel and a "
        "batch's end before the client is told, as the scheduler's flag (default "
        "$LLMSERVE_REDIS_MIN_REPLICAS or 0: the primary's reply is enough)",
    )
    g.add_argument("--redis-replica-timeout-ms", type=int, default=1000)
    d = BatchSettings()
    g.add_argument(
        "--batch-max-file-mb",
        type=float,
        default=d.max_file_bytes / 2**20,
        help="largest upload (files are kept whole in Redis)",
    )
    g.add_argument(
        "--batch-max-concurrency",
        type=int,
        default=d.max_concurrency,
        help="batch lines this frontend runs at once",
    )
    g.add_argument(
        "--batch-priority",
        type=int,
        default=d.priority,
        help="scheduler priority of batch lines (interactive requests: 0; it orders the queue "
        "with the scheduler's --policy priority)",
    )
    g.add_argument(
        "--batch-lease",
        type=float,
        default=d.lease_s,
        help="seconds after which a batch whose frontend died is taken over",
    )


def batch_settings(args: argparse.Namespace, env: Mapping[str, str]) -> BatchSettings:
    """The flags, falling back on the scheduler's variables in `env` (handed over by
    frontend_svc/config.py, the one module that reads the environment)."""
    if args.batch_max_concurrency < 1 or args.batch_max_file_mb <= 0 or args.batch_lease <= 0:
        raise SystemExit("--batch-max-concurrency, --batch-max-file-mb, --batch-lease: > 0")
    sentinels = args.redis_sentinel
    if sentinels is None and env.get("LLMSERVE_REDIS_SENTINEL"):
        try:
            sentinels = parse_sentinels(env["LLMSERVE_REDIS_SENTINEL"])
        except ValueError as e:
            raise SystemExit(f"LLMSERVE_REDIS_SENTINEL: {e}") from None
    min_replicas = args.redis_min_replicas
    if min_replicas is None:
        text = env.get("LLMSERVE_REDIS_MIN_REPLICAS") or "0"
        if not text.isdigit():
            raise SystemExit(f"LLMSERVE_REDIS_MIN_REPLICAS must be a count, not {text!r}")
        min_replicas = int(text)
    if min_replicas < 0 or args.redis_replica_timeout_ms < 1:
        raise SystemExit("--redis-min-replicas >= 0 and --redis-replica-timeout-ms >= 1")
    return BatchSettings(
        redis_url=args.redis_url,
        sentinels=sentinels or (),
        sentinel_master=args.redis_sentinel_master
        or env.get("LLMSERVE_REDIS_SENTINEL_MASTER")
        or "mymaster",
        sentinel_password=env.get("LLMSERVE_REDIS_SENTINEL_PASSWORD") or None,
        min_replicas=min_replicas,
        replica_timeout_ms=args.redis_replica_timeout_ms,
        max_file_bytes=int(args.batch_max_file_mb * 2**20),
        max_concurrency=args.batch_max_concurrency,
        priority=args.batch_priority,
        lease_s=args.batch_lease,
        poll_s=min(1.0, args.batch_lease / 4),
    )
