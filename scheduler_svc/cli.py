"""`llmserve-scheduler`: the public gRPC server in front of one or more executors."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

import structlog

from scheduler_svc import envs
from scheduler_svc.api.auth import load_api_keys
from scheduler_svc.api.server import SchedulerServer
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.spec_decode import SpeculativeConfig
from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.engine.fleet.routing import ROUTING_POLICIES
from scheduler_svc.engine.metrics import serve_metrics
from scheduler_svc.features.lora.registry import parse_lora_modules
from scheduler_svc.logging import configure_logging
from scheduler_svc.state.connect import parse_sentinels

log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve-scheduler", description=__doc__)
    p.add_argument(
        "--executor",
        action="append",
        default=[],
        help="executor address host:port (repeat for several; default 127.0.0.1:50061)",
    )
    p.add_argument(
        "--discover-executors",
        action="store_true",
        help="serve the executors registered in Redis (llmserve-executor --redis-url), "
        "including ones that start later; instead of --executor",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument(
        "--redis-url",
        default=envs.redis_url(),
        help="Redis holding request state (default $REDIS_URL; without it a loopback Redis "
        "server is started with its data in --redis-dir)",
    )
    p.add_argument("--redis-dir", type=Path, default=Path(".cache/redis"))
    p.add_argument(
        "--redis-sentinel",
        type=_sentinels,
        default=envs.redis_sentinel(),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="find the Redis primary through these Sentinels and follow it across failovers "
        "(default $LLMSERVE_REDIS_SENTINEL); --redis-url then gives only credentials, db and "
        "TLS (rediss://), and $LLMSERVE_REDIS_SENTINEL_PASSWORD the Sentinels' password",
    )
    p.add_argument(
        "--redis-sentinel-master",
        default=envs.redis_sentinel_master(),
        help="the primary's name in the Sentinels' configuration (default "
        "$LLMSERVE_REDIS_SENTINEL_MASTER or mymaster)",
    )
    p.add_argument(
        "--redis-min-replicas",
        type=int,
        default=envs.redis_min_replicas(),
        help="replicas that must acknowledge (WAIT) each step's writes before its tokens, "
        "finishes and aborts reach clients, and a new leader's epoch before it serves; one "
        "round trip per step (default $LLMSERVE_REDIS_MIN_REPLICAS or 0: the primary's reply "
        "is enough)",
    )
    p.add_argument(
        "--redis-replica-timeout-ms",
        type=int,
        default=500,
        help="how long each WAIT waits for --redis-min-replicas replicas before it counts as "
        "short (then health says so and the step is retried)",
    )
    p.add_argument(
        "--redis-degrade-unreplicated",
        action="store_true",
        help="release a step that fewer than --redis-min-replicas replicas acknowledged in "
        "time instead of holding its streams (metrics count each such step)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-waiting", type=int, default=4096, help="waiting queue cap")
    p.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help='speculative decoding, off by default; JSON like {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}, or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (the executors '
        "then need --speculative-model PATH). Outputs (greedy and seeded) are unchanged; only "
        "the speed changes",
    )
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="wait for each decode step's result before sending the next (by default the next "
        "is planned and sent while the executor still runs the current one)",
    )
    p.add_argument("--watermark", type=float, default=0.01)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--num-device-blocks", type=int, help="use at most this many KV blocks")
    p.add_argument("--num-cpu-blocks", type=int, help="use at most this many swap blocks")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--finished-ttl", type=float, default=3600.0, help="seconds")
    p.add_argument(
        "--abort-ahead-ttl",
        type=float,
        default=60.0,
        help="seconds an abort of an id not known yet waits for a Generate with that id",
    )
    p.add_argument("--max-backlog-steps", type=int, default=1024)
    p.add_argument(
        "--executor-failover",
        type=float,
        default=10.0,
        help="seconds an executor may be unreachable before its requests move to live ones",
    )
    p.add_argument(
        "--health-interval",
        type=float,
        default=0.5,
        help="seconds between health probes of Redis (a write) and of idle executors",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--tls-cert",
        type=Path,
        help="serve the public API over TLS with this certificate chain (PEM); also the "
        "client certificate shown to executors with --tls-ca",
    )
    p.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    p.add_argument(
        "--tls-ca",
        type=Path,
        help="talk to executors over TLS, verifying their certificates with this CA",
    )
    p.add_argument(
        "--executor-tls-server-name",
        help="with --tls-ca: the name executors' certificates must carry, whatever address is "
        "dialled (executors found in the registry or behind a scaled service name are dialled "
        "by IP; e.g. `executor` under docker compose)",
    )
    p.add_argument(
        "--max-requests-per-key", type=int, help="unfinished requests per API key (default: any)"
    )
    p.add_argument(
        "--max-queued-tokens-per-key",
        type=int,
        help="prompt tokens per API key in requests not yet started (default: any)",
    )
    p.add_argument(
        "--leader-election",
        action="store_true",
        help="run beside other schedulers on the same Redis: serve only while holding the "
        "leader lease, stand by (health NOT_SERVING) otherwise; a standby takes over within "
        "about 2 s of the leader's death and recovers every request",
    )
    p.add_argument(
        "--leader-lease-ttl",
        type=float,
        default=2.0,
        help="seconds the leader lease outlives its last renewal: how soon a standby takes over "
        "a dead leader. With --redis-sentinel make it longer than a Redis failover "
        "(down-after-milliseconds + ~1.5 s), or each failover also hands leadership over",
    )
    p.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="kv",
        help="which executor a new request goes to: kv (where its prompt prefix is cached, "
        "weighed against load; default), least-loaded, round-robin",
    )
    p.add_argument(
        "--routing-prefill-weight",
        type=float,
        default=1.0,
        help="kv routing: weight of a block to prefill against a block of an executor's "
        "load (above 1: keep requests where their prefix is cached longer)",
    )
    p.add_argument(
        "--no-reflection",
        action="store_true",
        help="do not serve gRPC reflection (it lists the API's methods to anyone)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="API keys, one per line (optionally followed by a name); with it or "
        "$LLMSERVE_API_KEY, calls need 'authorization: Bearer <key>'",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics over HTTP at /metrics on this port (0: any free port; "
        "default: off)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories the executors can read) served under these names",
    )
    p.add_argument("--log-json", action="store_true")
    return p


def _sentinels(text: str) -> tuple[tuple[str, int], ...]:
    try:
        return parse_sentinels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from_args(args: argparse.Namespace, redis_url: str) -> EngineConfig:
    return EngineConfig(
        executor_addresses=[] if args.discover_executors else args.executor or ["127.0.0.1:50061"],
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
        speculative=args.speculative_config,
        watermark=args.watermark,
        max_logprobs=args.max_logprobs,
        finished_ttl_s=args.finished_ttl,
        abort_ahead_ttl_s=args.abort_ahead_ttl,
        max_backlog_steps=args.max_backlog_steps,
        executor_failover_s=args.executor_failover,
        health_interval_s=args.health_interval,
        num_device_blocks=args.num_device_blocks,
        num_cpu_blocks=args.num_cpu_blocks,
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
        lora_modules=parse_lora_modules(args.lora_modules),
    )


async def run(args: argparse.Namespace) -> int:
    redis = None
    redis_url = args.redis_url
    if args.redis_sentinel:
        redis_url = redis_url or "redis://"  # only credentials, db and TLS count
    elif not redis_url:
        from scheduler_svc.local.redis_server import RedisServer

        redis = RedisServer(data_dir=args.redis_dir)
        redis.start()
        redis_url = redis.url
        log.info("redis.started", url=redis_url, data_dir=str(args.redis_dir))
    api_keys = load_api_keys(args.api_key_file)
    tls = (args.tls_cert.read_bytes(), args.tls_key.read_bytes()) if args.tls_cert else None
    server = SchedulerServer(
        config_from_args(args, redis_url),
        args.host,
        args.port,
        api_keys=api_keys,
        tls=tls,
        reflection=not args.no_reflection,
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
        if args.metrics_port is not None:
            metrics_port = serve_metrics(server.engine.metrics, args.host, args.metrics_port)
            log.info("metrics.listening", host=args.host, port=metrics_port)
        if args.port_file:
            args.port_file.write_text(str(port))
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
    configure_logging(args.log_level, json=args.log_json)
    with contextlib.suppress(KeyboardInterrupt):
        code = asyncio.run(run(args))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
