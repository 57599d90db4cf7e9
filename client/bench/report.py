"""Benchmark results as JSON and a markdown table, llmserve ÷ hf ratios, and the sweep plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Metrics that get a llmserve ÷ hf ratio: > 1 is better for throughputs, < 1 for latencies.
RATIO_KEYS = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)

_THROUGHPUT_COLUMNS = [
    ("backend", "backend"),
    ("completed", "ok"),
    ("failed", "failed"),
    ("duration_s", "time (s)"),
    ("request_throughput", "req/s"),
    ("output_throughput", "output tok/s"),
    ("total_token_throughput", "total tok/s"),
]
_SERVE_COLUMNS = [
    ("backend", "backend"),
    ("request_rate", "rate (req/s)"),
    ("completed", "ok"),
    ("failed", "failed"),
    ("request_throughput", "req/s"),
    ("output_throughput", "output tok/s"),
    ("mean_ttft_ms", "TTFT mean"),
    ("median_ttft_ms", "TTFT median"),
    ("p99_ttft_ms", "TTFT p99"),
    ("mean_tpot_ms", "TPOT mean"),
    ("median_tpot_ms", "TPOT median"),
    ("p99_tpot_ms", "TPOT p99"),
    ("mean_itl_ms", "ITL mean"),
    ("median_itl_ms", "ITL median"),
    ("p99_itl_ms", "ITL p99"),
    ("mean_e2el_ms", "E2E mean"),
    ("median_e2el_ms", "E2E median"),
    ("p99_e2el_ms", "E2E p99"),
    ("goodput", "goodput (req/s)"),
]


BASELINES = ("hf", "vllm", "openai")


def _run_key(result: dict[str, Any]) -> tuple[str, str]:
    return result["mode"], str(result.get("request_rate", ""))


def compute_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every (mode, rate) llmserve and a baseline (hf, vllm, openai) both ran:
    metric -> llmserve value / baseline value, one entry per baseline."""
    by_key: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for result in results:
        by_key.setdefault(_run_key(result), {})[result["backend"]] = result
    ratios = []
    for (mode, _rate), runs in by_key.items():
        for baseline in BASELINES:
            if "llmserve" in runs and baseline in runs:
                ratios.append(_ratio(mode, runs["llmserve"], runs[baseline], baseline))
    return ratios


def _ratio(mode: str, ours: dict[str, Any], base: dict[str, Any], baseline: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"mode": mode}
    if mode == "serve":
        entry["request_rate"] = ours.get("request_rate")
    entry["baseline"] = baseline
    for key in RATIO_KEYS:
        a, b = ours.get(key), base.get(key)
        if _is_number(a) and _is_number(b) and b != 0:
            entry[key] = a / b
    return entry


def build_report(config: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"config": config, "results": results, "ratios": compute_ratios(results)}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _clean(value: Any) -> Any:
    """NaN/inf -> None (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> list[str]:
    present = [(k, h) for k, h in columns if any(k in r for r in rows)]
    lines = [
        "| " + " | ".join(h for _, h in present) + " |",
        "|" + "|".join("---" for _ in present) + "|",
    ]
    lines += ["| " + " | ".join(_fmt(r.get(k)) for k, _ in present) + " |" for r in rows]
    return lines


def to_markdown(report: dict[str, Any]) -> str:
    """Tables per mode (latencies in ms), then the llmserve ÷ hf ratios when both ran."""
    config = report.get("config", {})
    lines = []
    if config:
        summary = ", ".join(f"{k}={v}" for k, v in config.items() if v is not None)
        lines += [f"Config: {summary}", ""]
    results = report.get("results", [])
    throughput = [r for r in results if r["mode"] == "throughput"]
    serve = [r for r in results if r["mode"] == "serve"]
    if throughput:
        lines += ["### Throughput", "", *_table(throughput, _THROUGHPUT_COLUMNS), ""]
    if serve:
        lines += ["### Serving (latencies in ms)", "", *_table(serve, _SERVE_COLUMNS), ""]
    ratios = report.get("ratios", [])
    columns = [("mode", "mode"), ("request_rate", "rate")]
    columns += [(k, k) for k in RATIO_KEYS]
    for baseline in BASELINES:
        rows = [r for r in ratios if r.get("baseline", "hf") == baseline]
        if rows:
            lines += [f"### llmserve ÷ {baseline}", "", *_table(rows, columns), ""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], json_path: str | Path) -> tuple[Path, Path]:
    """Write `json_path` and the markdown table next to it (same name, `.md`)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_clean(report), indent=2, allow_nan=False) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(to_markdown(report) + "\n")
    return json_path, md_path


def plot_sweep(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Latency against request rate, one line per backend (finite rates only)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    panels = [
        ("TTFT (ms)", ("median_ttft_ms", "p99_ttft_ms")),
        ("TPOT (ms)", ("median_tpot_ms", "p99_tpot_ms")),
        ("end-to-end latency (ms)", ("median_e2el_ms", "p99_e2el_ms")),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    backends = sorted({r["backend"] for r in results})
    for ax, (title, keys) in zip(axes[0], panels, strict=True):
        for backend in backends:
            runs = [
                r for r in results if r["backend"] == backend and _is_number(r.get("request_rate"))
            ]
            runs.sort(key=lambda r: r["request_rate"])
            for key, style in zip(keys, ("-o", "--x"), strict=True):
                xs = [r["request_rate"] for r in runs if _is_number(r.get(key))]
                ys = [r[key] for r in runs if _is_number(r.get(key))]
                if xs:
                    ax.plot(xs, ys, style, label=f"{backend} {key.split('_')[0]}")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
