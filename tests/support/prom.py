"""Reading a running service's Prometheus metrics as Prometheus would: over HTTP, parsed with
prometheus_client's own exposition parser."""

from __future__ import annotations

import random
import socket
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port for a server that must be told its port before it starts.

    Drawn below the OS's ephemeral range: a port the OS hands out for port 0 (the executor's,
    Redis's, any client socket) can then never take it between this choice and the bind.
    """
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if want <= set(k))
