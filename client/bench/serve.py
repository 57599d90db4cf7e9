"""Online serving: arrivals on a Poisson (or gamma) schedule; latency and goodput."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from client.bench.backends import Backend
from client.bench.metrics import arrival_offsets, compute_metrics
from client.bench.workloads import BenchRequest


def parse_rate(value: str) -> float:
    """`"inf"` or a positive number of requests per second."""
    rate = float(value)
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be > 0 or inf, got {value}")
    return rate


def run_serve(
    backend: Backend,
    requests: list[BenchRequest],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    burstiness: float = 1.0,
    seed: int = 0,
    slo: Mapping[str, float] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    offsets = arrival_offsets(len(requests), request_rate, seed=seed, burstiness=burstiness)
    records, duration = backend.run(
        requests, offsets, max_concurrency=max_concurrency, progress=progress
    )
    result: dict[str, Any] = {
        "mode": "serve",
        "backend": backend.name,
        # JSON has no infinity; "inf" keeps the file valid and readable.
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "max_concurrency": max_concurrency,
        "burstiness": burstiness,
    }
    if slo:
        result["slo_ms"] = dict(slo)
    result.update(compute_metrics(records, duration, slo=slo))
    errors = sorted({r.error for r in records if r.error})
    if errors:
        result["errors"] = errors[:5]
    return result


def run_sweep(
    backend: Backend,
    requests: list[BenchRequest],
    rates: list[float],
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """`run_serve` once per rate, same requests and seed, lowest rate first."""
    return [run_serve(backend, requests, request_rate=rate, **kwargs) for rate in sorted(rates)]
