"""`llmserve health TARGET`: exit 0 only if TARGET is serving; for container healthchecks and
Kubernetes probes (exec form, no argument with spaces, the same in every engine).

TARGET is a gRPC `host:port` (grpc.health.v1: the scheduler or an executor, SERVING) or an
`http(s)://` URL (the frontend's /health, status 200). TLS options as the services take them.
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["add_health_parser", "check"]


def check(
    target: str,
    *,
    timeout: float = 3.0,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> tuple[bool, str]:
    """(serving, what was seen)."""
    if target.startswith(("http://", "https://")):
        context = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else None
        try:
            with urllib.request.urlopen(target, timeout=timeout, context=context) as r:
                return r.status == 200, f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return False, f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            return False, f"unreachable: {e}"
    if tls_ca or tls_cert:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls_ca.read_bytes() if tls_ca else None,
            private_key=tls_key.read_bytes() if tls_key else None,
            certificate_chain=tls_cert.read_bytes() if tls_cert else None,
        )
        channel = grpc.secure_channel(target, credentials)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, name


def cmd_health(args: argparse.Namespace) -> int:
    ok, seen = check(
        args.target,
        timeout=args.timeout,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    print(seen, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def add_health_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "health", help="exit 0 if a scheduler, executor (host:port) or frontend (URL) serves"
    )
    p.add_argument("target", help="host:port (gRPC health) or http(s)://host:port/health")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--tls-ca", type=Path, help="trust this CA (TLS)")
    p.add_argument("--tls-cert", type=Path, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, help="its private key")
    p.set_defaults(func=cmd_health)
