"""Per-request timing records, the serving metrics computed from them, and arrival schedules.

Definitions (all times from `time.perf_counter`, reported in milliseconds). A request's start
is its scheduled arrival (offset 0 for every request in the throughput mode), so queueing, in
the system or for a --max-concurrency slot, counts towards its latency on every backend.
- TTFT: first output token received - request start.
- TPOT: (last token - first token) / (output tokens - 1), per request; requests with a single
  output token have no TPOT.
- ITL: gaps between consecutive output tokens of a request, gathered over all requests. Tokens
  that arrive in one message share a timestamp and contribute zero gaps.
- E2EL: last token (or failure) - request start.
- Goodput: successful requests per second whose TTFT, TPOT and E2EL are all within the given
  SLOs (an SLO not given is not checked; a request without TPOT meets any TPOT SLO).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    expected_output_len: int
    start_time: float  # scheduled arrival (perf_counter)
    token_times: list[float] = field(default_factory=list)  # one per output token
    end_time: float = 0.0
    success: bool = False
    error: str = ""

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start_time if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def e2el(self) -> float:
        return self.end_time - self.start_time


def _stats(name: str, values_s: Iterable[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean/median/pNN of `values_s` (seconds) as `{mean_name_ms: ...}`; NaN when empty, so a
    missing measurement never looks like a fast one."""
    arr = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(arr.mean()) if arr.size else math.nan,
        f"median_{name}_ms": float(np.median(arr)) if arr.size else math.nan,
    }
    for p in percentiles:
        label = f"{p:g}".replace(".", "_")
        out[f"p{label}_{name}_ms"] = float(np.percentile(arr, p)) if arr.size else math.nan
    return out


def parse_slo(items: Iterable[str]) -> dict[str, float]:
    """`["ttft=500", "tpot_ms=50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().removesuffix("_ms")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {item!r}; expected KEY=MS with KEY in {', '.join(SLO_KEYS)}")
        slo[key] = float(value)
        if slo[key] <= 0:
            raise ValueError(f"SLO {key} must be > 0 ms, got {value}")
    return slo


def meets_slo(rec: RequestRecord, slo: Mapping[str, float]) -> bool:
    if not rec.success:
        return False
    if "ttft" in slo and (rec.ttft is None or rec.ttft * 1000 > slo["ttft"]):
        return False
    if "tpot" in slo and rec.tpot is not None and rec.tpot * 1000 > slo["tpot"]:
        return False
    return not ("e2el" in slo and rec.e2el * 1000 > slo["e2el"])


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    *,
    slo: Mapping[str, float] | None = None,
    percentiles: Iterable[float] = (99,),
) -> dict[str, float | int]:
    """Aggregate metrics of one benchmark run that took `duration_s` seconds of wall time."""
    ok = [r for r in records if r.success]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    percentiles = list(percentiles)
    metrics: dict[str, float | int] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    metrics.update(_stats("ttft", (r.ttft for r in ok if r.ttft is not None), percentiles))
    metrics.update(_stats("tpot", (r.tpot for r in ok if r.tpot is not None), percentiles))
    metrics.update(_stats("itl", (g for r in ok for g in r.itls), percentiles))
    metrics.update(_stats("e2el", (r.e2el for r in ok), percentiles))
    if slo:
        metrics["goodput"] = sum(meets_slo(r, slo) for r in records) / duration_s
    return metrics


def arrival_offsets(
    num_requests: int, request_rate: float, *, seed: int = 0, burstiness: float = 1.0
) -> list[float]:
    """Send times in seconds after the start: the first at 0, then gaps drawn from a gamma
    distribution with mean 1/request_rate (burstiness 1 = exponential = a Poisson process;
    smaller is burstier). An infinite rate sends everything at once."""
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
