"""`llmserve-scheduler`: the public gRPC server in front of one or more executors."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import os
import signal
import sys
import threading

import structlog

from scheduler_svc import tracing
from scheduler_svc.api.auth import load_api_keys
from scheduler_svc.api.server import SchedulerServer
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.engine.metrics import serve_metrics
from scheduler_svc.flags import build_parser
from scheduler_svc.logging import configure_logging
from scheduler_svc.settings import SchedulerSettings

log = structlog.get_logger(__name__)


async def run(settings: SchedulerSettings) -> int:
    tracing.setup()  # off unless the OTEL_* variables ask for it
    redis = None
    engine, server_settings = settings.engine, settings.server
    if not engine.redis_url:
        from scheduler_svc.local.redis_server import RedisServer

        redis = RedisServer(data_dir=settings.redis_dir)
        redis.start()
        engine = dataclasses.replace(engine, redis_url=redis.url)
        log.info("redis.started", url=redis.url, data_dir=str(settings.redis_dir))
    api_keys = load_api_keys(server_settings.api_key_file, server_settings.env_api_key)
    server = SchedulerServer(
        engine,
        server_settings.host,
        server_settings.port,
        api_keys=api_keys,
        tls=server_settings.tls,
        reflection=server_settings.reflection,
    )
    if api_keys:
        log.info("auth.enabled", num_keys=len(api_keys))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if not stop.is_set():
            arm_stop_watchdog(STOP_DEADLINE_S)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        port = await server.start()
        host, metrics_port = server_settings.host, server_settings.metrics_port
        if metrics_port is not None:
            metrics_port = serve_metrics(server.engine.metrics, host, metrics_port)
            log.info("metrics.listening", host=host, port=metrics_port)
        if server_settings.port_file:
            server_settings.port_file.write_text(str(port))
        lost = asyncio.create_task(server.engine.lifecycle.leadership_lost.wait())
        stopping = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(server.engine.lifecycle.failed.wait())
        await asyncio.wait({lost, stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            print(f"llmserve-scheduler: error: {server.engine.lifecycle.failure}", file=sys.stderr)
            return 2
        if lost.done() and not stop.is_set():
            # Another scheduler leads: nothing here may write again. Start over as a standby
            # (a fresh process: no state of this term survives).
            log.warning("scheduler.restarting_as_standby")
            restart_as_standby()
        log.info("scheduler.stopping")
    finally:
        await server.stop()
        if redis is not None:
            redis.close()
    return 0


def restart_as_standby() -> None:
    """Replace this process by a fresh one with the same command line."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


# A stop (SIGTERM/SIGINT) drains for up to 5 s, flushes Redis for up to 5 s and closes the
# servers with 5 s of grace; a process still alive this long after the signal is stuck (once
# seen in CI: a scheduler whose executor failed its TLS handshake outlived 30 s after SIGTERM)
# and exits with every thread's stack on stderr, so that a stop always ends.
STOP_DEADLINE_S = 25.0


def arm_stop_watchdog(seconds: float) -> threading.Timer:
    """A daemon timer that, unless the process has exited by then, prints every thread's stack
    and ends the process (exit code 3)."""

    def expire() -> None:
        print(
            f"llmserve-scheduler: still stopping {seconds:.0f}s after the signal; "
            "stacks follow, then exit",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.discover_executors and args.executor:
        # One executor known under two names (a static alias and its registered address) could
        # end up with two block managers for one KV cache: pick one way of finding executors.
        parser.error("--discover-executors and --executor exclude each other")
    if args.leader_election and not (args.redis_url or args.redis_sentinel):
        parser.error(
            "--leader-election needs --redis-url or --redis-sentinel (the Redis every "
            "scheduler shares)"
        )
    if args.leader_lease_ttl <= 0.5:
        parser.error("--leader-lease-ttl must be above the 0.5 s renewal interval")
    if args.redis_min_replicas < 0 or args.redis_replica_timeout_ms <= 0:
        parser.error("--redis-min-replicas must be >= 0 and --redis-replica-timeout-ms > 0")
    if args.executor_tls_server_name and not args.tls_ca:
        parser.error("--executor-tls-server-name needs --tls-ca")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    try:
        # The per-executor policy checks its limits when an executor connects; check the ones
        # given here now, so a bad combination is a one-line usage error, not a crash later.
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            policy=args.policy,
            preemption_mode=args.preemption_mode,
            watermark=args.watermark,
            max_waiting=args.max_waiting,
        )
    except ValueError as e:
        parser.error(str(e))
    settings = SchedulerSettings.from_args(args)
    configure_logging(settings.server.log_level, json=settings.server.log_json)
    with contextlib.suppress(KeyboardInterrupt):
        code = asyncio.run(run(settings))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
