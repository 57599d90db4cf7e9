"""Offline throughput: every request submitted at once; requests/s and tokens/s."""

from __future__ import annotations

from typing import Any

from client.bench.backends import Backend
from client.bench.metrics import compute_metrics
from client.bench.workloads import BenchRequest

THROUGHPUT_KEYS = (
    "completed",
    "failed",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
)


def run_throughput(
    backend: Backend, requests: list[BenchRequest], *, progress: bool = True
) -> dict[str, Any]:
    """One throughput run; the result holds the throughput keys above and the backend name."""
    records, duration = backend.run(requests, [0.0] * len(requests), progress=progress)
    metrics = compute_metrics(records, duration)
    result: dict[str, Any] = {"mode": "throughput", "backend": backend.name}
    result.update({key: metrics[key] for key in THROUGHPUT_KEYS})
    errors = sorted({r.error for r in records if r.error})
    if errors:
        result["errors"] = errors[:5]
    return result
