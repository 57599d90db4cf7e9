"""The scheduler's command line: its flags, grouped by concern as ``--help`` shows them, and the
environment variables that give some of them their defaults (``scheduler_svc/envs.py``, the
only module of the scheduler that reads the environment)."""

from __future__ import annotations

import argparse
from pathlib import Path

from scheduler_svc import envs
from scheduler_svc.engine.fleet.routing import ROUTING_POLICIES
from scheduler_svc.features.deadlines.timeouts import check_timeout
from scheduler_svc.features.flags import add_feature_flags
from scheduler_svc.state.connect import parse_sentinels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmserve-scheduler",
        description=__doc__,
        epilog=ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, about, add_flags in FLAG_GROUPS:
        add_flags(p.add_argument_group(name, about))
    return p


def _server_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    g.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    g.add_argument("--log-level", default="info")
    g.add_argument("--log-json", action="store_true")
    g.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics over HTTP at /metrics on this port (0: any free port; "
        "default: off)",
    )
    g.add_argument(
        "--no-reflection",
        action="store_true",
        help="do not serve gRPC reflection (it lists the API's methods to anyone)",
    )


def _executors_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--executor",
        action="append",
        default=[],
        help="executor address host:port (repeat for several; default 127.0.0.1:50061)",
    )
    g.add_argument(
        "--discover-executors",
        action="store_true",
        help="serve the executors registered in Redis (llmserve-executor --redis-url), "
        "including ones that start later; instead of --executor",
    )
    g.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default="kv",
        help="which executor a new request goes to: kv (where its prompt prefix is cached, "
        "weighed against load; default), least-loaded, round-robin",
    )
    g.add_argument(
        "--routing-prefill-weight",
        type=float,
        default=1.0,
        help="kv routing: weight of a block to prefill against a block of an executor's "
        "load (above 1: keep requests where their prefix is cached longer)",
    )
    g.add_argument(
        "--executor-failover",
        type=float,
        default=10.0,
        help="seconds an executor may be unreachable before its requests move to live ones",
    )
    g.add_argument(
        "--no-migrate-on-drain",
        action="store_true",
        help="when an executor drains (SIGTERM), let it finish what it runs and recompute the "
        "rest elsewhere once it is gone, instead of moving its running requests with their KV "
        "cache to other executors at once (live migration)",
    )
    g.add_argument(
        "--migrate-transport",
        choices=["auto", "grpc", "shm", "push"],
        default="auto",
        help="how migrated KV travels: shared memory when both executors have loopback "
        "addresses (auto), else pushed by the source executor straight to the destination "
        "(push) when both can, else relayed through the scheduler in the gRPC stream (grpc)",
    )
    g.add_argument(
        "--migrate-chunk-bytes",
        type=int,
        default=0,
        help="payload bytes per chunk of migrated KV in the gRPC stream, at most 64 MiB "
        "(0: the executor's default, 2 MiB)",
    )
    g.add_argument(
        "--health-interval",
        type=float,
        default=0.5,
        help="seconds between health probes of Redis (a write) and of idle executors",
    )


def _scheduling_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-waiting", type=int, default=4096, help="waiting queue cap")
    g.add_argument(
        "--request-timeout",
        type=_timeout,
        default=None,
        help="seconds from arrival after which a request ends (waiting: DEADLINE_EXCEEDED; "
        "running: finished with the tokens so far); a request's own shorter timeout wins "
        "(default: none)",
    )
    g.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="wait for each decode step's result before sending the next (by default the next "
        "is planned and sent while the executor still runs the current one)",
    )
    g.add_argument("--watermark", type=float, default=0.01)
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--num-device-blocks", type=int, help="use at most this many KV blocks")
    g.add_argument("--num-cpu-blocks", type=int, help="use at most this many swap blocks")
    g.add_argument(
        "--host-cache-blocks",
        type=int,
        default=0,
        help="host-memory prefix tier: of each executor's CPU blocks (its --swap-space), keep "
        "this many for prefix blocks evicted from the device, copied back in on a later hit "
        "instead of recomputed; swap keeps the rest (default 0: no tier)",
    )
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-backlog-steps", type=int, default=1024)


def _features_flags(g: argparse._ArgumentGroup) -> None:
    add_feature_flags(g)  # the flags features declare in their folders (features/flags.py)


def _state_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--redis-url",
        default=envs.redis_url(),
        help="Redis holding request state (default $REDIS_URL; without it a loopback Redis "
        "server is started with its data in --redis-dir)",
    )
    g.add_argument("--redis-dir", type=Path, default=Path(".cache/redis"))
    g.add_argument(
        "--redis-sentinel",
        type=_sentinels,
        default=envs.redis_sentinel(),
        metavar="HOST:PORT[,HOST:PORT...]",
        help="find the Redis primary through these Sentinels and follow it across failovers "
        "(default $LLMSERVE_REDIS_SENTINEL); --redis-url then gives only credentials, db and "
        "TLS (rediss://), and $LLMSERVE_REDIS_SENTINEL_PASSWORD the Sentinels' password",
    )
    g.add_argument(
        "--redis-sentinel-master",
        default=envs.redis_sentinel_master(),
        help="the primary's name in the Sentinels' configuration (default "
        "$LLMSERVE_REDIS_SENTINEL_MASTER or mymaster)",
    )
    g.add_argument(
        "--redis-min-replicas",
        type=int,
        default=envs.redis_min_replicas(),
        help="replicas that must acknowledge (WAIT) each step's writes before its tokens, "
        "finishes and aborts reach clients, and a new leader's epoch before it serves; one "
        "round trip per step (default $LLMSERVE_REDIS_MIN_REPLICAS or 0: the primary's reply "
        "is enough)",
    )
    g.add_argument(
        "--redis-replica-timeout-ms",
        type=int,
        default=500,
        help="how long each WAIT waits for --redis-min-replicas replicas before it counts as "
        "short (then health says so and the step is retried)",
    )
    g.add_argument(
        "--redis-degrade-unreplicated",
        action="store_true",
        help="release a step that fewer than --redis-min-replicas replicas acknowledged in "
        "time instead of holding its streams (metrics count each such step)",
    )
    g.add_argument("--finished-ttl", type=float, default=3600.0, help="seconds")
    g.add_argument(
        "--abort-ahead-ttl",
        type=float,
        default=60.0,
        help="seconds an abort of an id not known yet waits for a Generate with that id",
    )


def _leadership_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--leader-election",
        action="store_true",
        help="run beside other schedulers on the same Redis: serve only while holding the "
        "leader lease, stand by (health NOT_SERVING) otherwise; a standby takes over within "
        "about 2 s of the leader's death and recovers every request",
    )
    g.add_argument(
        "--leader-lease-ttl",
        type=float,
        default=2.0,
        help="seconds the leader lease outlives its last renewal: how soon a standby takes over "
        "a dead leader. With --redis-sentinel make it longer than a Redis failover "
        "(down-after-milliseconds + ~1.5 s), or each failover also hands leadership over",
    )


def _security_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--tls-cert",
        type=Path,
        help="serve the public API over TLS with this certificate chain (PEM); also the "
        "client certificate shown to executors with --tls-ca",
    )
    g.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    g.add_argument(
        "--tls-ca",
        type=Path,
        help="talk to executors over TLS, verifying their certificates with this CA",
    )
    g.add_argument(
        "--executor-tls-server-name",
        help="with --tls-ca: the name executors' certificates must carry, whatever address is "
        "dialled (executors found in the registry or behind a scaled service name are dialled "
        "by IP; e.g. `executor` under docker compose)",
    )
    g.add_argument(
        "--api-key-file",
        type=Path,
        help="API keys, one per line (optionally followed by a name); with it or "
        "$LLMSERVE_API_KEY, calls need 'authorization: Bearer <key>'",
    )
    g.add_argument(
        "--max-requests-per-key", type=int, help="unfinished requests per API key (default: any)"
    )
    g.add_argument(
        "--max-queued-tokens-per-key",
        type=int,
        help="prompt tokens per API key in requests not yet started (default: any)",
    )


FLAG_GROUPS = [
    ("server", "the public gRPC server, logs and metrics", _server_flags),
    (
        "executors",
        "which executors, how requests are routed to them, when they count as dead",
        _executors_flags,
    ),
    (
        "scheduling",
        "the per-executor policy: budgets, queues, preemption, KV blocks",
        _scheduling_flags,
    ),
    ("features", "optional features", _features_flags),
    ("state", "Redis: request state, its replication and lifetimes", _state_flags),
    ("leadership", "several schedulers on one Redis", _leadership_flags),
    ("security", "TLS, API keys and per-key limits", _security_flags),
]
ENVIRONMENT_HELP = """\
environment (flags win where both exist; scheduler_svc/envs.py):
  REDIS_URL                          default of --redis-url
  LLMSERVE_REDIS_SENTINEL            default of --redis-sentinel
  LLMSERVE_REDIS_SENTINEL_MASTER     default of --redis-sentinel-master (mymaster)
  LLMSERVE_REDIS_SENTINEL_PASSWORD   the Sentinels' own password (no flag: not in a process list)
  LLMSERVE_REDIS_MIN_REPLICAS        default of --redis-min-replicas (0)
  LLMSERVE_API_KEY                   one API key, besides --api-key-file's
  LLMSERVE_FAILPOINTS                fault injection for tests (scheduler_svc/failpoints.py)
  OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_SDK_DISABLED
                                     OpenTelemetry traces (off unless an exporter or endpoint is named)
  LLMSERVE_TRACE_STEP_EVERY          with tracing on, trace one engine step in this many (100)
"""


def _sentinels(text: str) -> tuple[tuple[str, int], ...]:
    try:
        return parse_sentinels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _timeout(text: str) -> float:
    try:
        return check_timeout(float(text), "--request-timeout")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
