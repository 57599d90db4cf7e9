"""The scheduler's configuration: one typed object, ``SchedulerSettings``, built once by the CLI
from its flags (``flags.py``) and the environment (``envs.py``, the only module that reads it),
and handed to what runs the service: the engine's part (``EngineConfig``), the public server's,
and where an embedded Redis keeps its data when no Redis is named.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from scheduler_svc import envs
from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.features.flags import feature_settings

__all__ = ["SchedulerSettings", "ServerSettings"]

DEFAULT_EXECUTOR = "127.0.0.1:50061"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The public gRPC server, its logs and metrics, and who may call it."""

    host: str
    port: int  # 0: any free port
    port_file: Path | None
    metrics_port: int | None  # None: no metrics server
    reflection: bool
    log_level: str
    log_json: bool
    tls: tuple[bytes, bytes] | None  # (certificate chain, key), read from --tls-cert/--tls-key
    api_key_file: Path | None
    env_api_key: str  # $LLMSERVE_API_KEY ("" = none); the file may add more


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    server: ServerSettings
    # redis_url is "" when neither --redis-url/$REDIS_URL nor Sentinels name one: the CLI then
    # starts a loopback Redis with its data in redis_dir and fills it in.
    engine: EngineConfig
    redis_dir: Path

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SchedulerSettings:
        tls = (args.tls_cert.read_bytes(), args.tls_key.read_bytes()) if args.tls_cert else None
        server = ServerSettings(
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            metrics_port=args.metrics_port,
            reflection=not args.no_reflection,
            log_level=args.log_level,
            log_json=args.log_json,
            tls=tls,
            api_key_file=args.api_key_file,
            env_api_key=envs.api_key(),
        )
        # With Sentinels the URL gives only credentials, db and TLS.
        redis_url = args.redis_url or ("redis://" if args.redis_sentinel else "")
        return cls(server, engine_config(args, redis_url), args.redis_dir)


def engine_config(args: argparse.Namespace, redis_url: str) -> EngineConfig:
    return EngineConfig(
        executor_addresses=[] if args.discover_executors else args.executor or [DEFAULT_EXECUTOR],
        discover_executors=args.discover_executors,
        routing=args.routing,
        routing_prefill_weight=args.routing_prefill_weight,
        redis_url=redis_url,
        redis_sentinels=args.redis_sentinel or (),
        redis_sentinel_master=args.redis_sentinel_master,
        redis_sentinel_password=envs.redis_sentinel_password(),
        redis_min_replicas=args.redis_min_replicas,
        redis_replica_timeout_ms=args.redis_replica_timeout_ms,
        redis_degrade_unreplicated=args.redis_degrade_unreplicated,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        max_requests_per_key=args.max_requests_per_key,
        max_queued_tokens_per_key=args.max_queued_tokens_per_key,
        policy=args.policy,
        preemption_mode=args.preemption_mode,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=not args.no_async_scheduling,
        watermark=args.watermark,
        max_logprobs=args.max_logprobs,
        finished_ttl_s=args.finished_ttl,
        abort_ahead_ttl_s=args.abort_ahead_ttl,
        request_timeout_s=args.request_timeout,
        max_backlog_steps=args.max_backlog_steps,
        executor_failover_s=args.executor_failover,
        migrate_on_drain=not args.no_migrate_on_drain,
        migrate_transport=args.migrate_transport,
        migrate_chunk_bytes=args.migrate_chunk_bytes,
        health_interval_s=args.health_interval,
        num_device_blocks=args.num_device_blocks,
        num_cpu_blocks=args.num_cpu_blocks,
        host_cache_blocks=args.host_cache_blocks,
        max_model_len=args.max_model_len,
        executor_tls=(
            (
                args.tls_ca.read_bytes(),
                args.tls_cert.read_bytes() if args.tls_cert else None,
                args.tls_key.read_bytes() if args.tls_key else None,
            )
            if args.tls_ca
            else None
        ),
        executor_tls_server_name=args.executor_tls_server_name,
        leader_election=args.leader_election,
        lease_ttl_s=args.leader_lease_ttl,
        **feature_settings(args),
    )
